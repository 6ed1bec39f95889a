'''
cachefs_peer_reads.pxi — cachefs's patch: the Python API of peer reads sent from C.

Included by __init__.pyx after handlers.pxi (it makes the coroutine of handlers.pxi's
fuse_read_async for a READ handed back). The connections, routes and answers are in
cachefs_fast_read.c ("peer reads"); cachefs/fs/native_peer_reads.py drives them.
'''

from libc.stdlib cimport free, malloc

cdef extern from "cachefs_fast_read.h":
    ctypedef struct cfr_peer_handback:
        fuse_req_t req
        uint64_t fh
        uint64_t size
        int64_t off
    int CFR_PEER_PENDING_MAX
    int cfr_peer_open(int fd, uint64_t max_length)
    int cfr_peer_slots()
    int cfr_register_peer_route(uint64_t ino, int slot, const unsigned char *frame, size_t len,
                                uint64_t length)
    int cfr_peer_receive(int slot, cfr_peer_handback *out, size_t *handed, uint64_t *pending,
                         int64_t *oldest_age_ns)
    void cfr_peer_close(int slot, int fail, cfr_peer_handback *out, size_t *handed)


cdef list _handed_back(cfr_peer_handback *out, size_t handed):
    '''The READs handed back, as the coroutines fuse_read() would have run for them.'''
    cdef _Container c
    cdef size_t i
    coroutines = []
    for i in range(handed):
        c = _Container()
        c.req = out[i].req
        c.size = out[i].size
        c.off = out[i].off
        c.fh = out[i].fh
        coroutines.append(fuse_read_async(c))
    return coroutines


def fast_peer_open(int sock_fd, uint64_t max_length):
    '''Hand the handshaken, non-blocking socket ``sock_fd`` to the C side for READs of blocks
    up to ``max_length`` bytes: its slot, or -1 when every slot is taken. The socket stays the
    caller's (close it after fast_peer_close()).'''
    return cfr_peer_open(sock_fd, max_length)


def fast_peer_slots():
    '''How many connections fast_peer_open() can hand out at once.'''
    return cfr_peer_slots()


def fast_peer_route(uint64_t ino, int slot, bytes frame, uint64_t length):
    '''Send READs of inode ``ino`` that the table cannot answer to the slot's owner as
    ``frame`` (a request frame of the file's one block, ``length`` bytes); False if refused.'''
    return cfr_register_peer_route(ino, slot, <const unsigned char *> (<const char *> frame),
                                   len(frame), length) == 0


def fast_peer_receive(int slot):
    '''Handle the answers waiting on the slot's socket: ``(fault, handed_back, pending,
    oldest_age_s)``: ``fault`` 0 while the connection is fine, else why it is closed now;
    ``handed_back`` the coroutines of the READs to serve in Python (run each); ``pending`` the
    READs still waiting, the oldest sent ``oldest_age_s`` ago.'''
    cdef cfr_peer_handback *out = <cfr_peer_handback *> malloc(
        CFR_PEER_PENDING_MAX * sizeof(cfr_peer_handback))
    cdef size_t handed = 0
    cdef uint64_t pending = 0
    cdef int64_t age_ns = 0
    cdef int fault
    if out == NULL:
        raise MemoryError()
    try:
        fault = cfr_peer_receive(slot, out, &handed, &pending, &age_ns)
        return fault, _handed_back(out, handed), pending, age_ns / 1e9
    finally:
        free(out)


def fast_peer_close(int slot, bint fail):
    '''Close the slot: the coroutines of its pending READs to run (or, ``fail``, none: they are
    answered EIO, for a session that is ending).'''
    cdef cfr_peer_handback *out = <cfr_peer_handback *> malloc(
        CFR_PEER_PENDING_MAX * sizeof(cfr_peer_handback))
    cdef size_t handed = 0
    if out == NULL:
        raise MemoryError()
    try:
        cfr_peer_close(slot, fail, out, &handed)
        return _handed_back(out, handed)
    finally:
        free(out)
