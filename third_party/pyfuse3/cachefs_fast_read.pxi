'''
cachefs_fast_read.pxi — cachefs's patch: the Python API of the native READ fast path.

Included by __init__.pyx (third_party/pyfuse3/build.py adds the include). The table and the
READ itself are in cachefs_fast_read.c; cachefs/fs/native_reads.py keeps the table coherent.
'''

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int64_t, uint64_t

cdef extern from "cachefs_fast_read.h":
    ctypedef struct cfr_stats_t:
        uint64_t reads
        uint64_t first_reads
        uint64_t bytes
        uint64_t fallbacks
        uint64_t vanished
        uint64_t corrupt
        uint64_t blocks
        uint64_t files
        uint64_t registered
        uint64_t refused
        uint64_t limit_drops
        uint64_t lookups
        uint64_t dentries
        uint64_t open_files
        uint64_t batches
        uint64_t batched
        uint64_t unwaited
        uint64_t readdirs
        uint64_t opendirs
        uint64_t listings
        uint64_t listing_bytes
        uint64_t passthrough
        uint64_t pt_opens
        uint64_t cached_opens
        uint64_t pt_refused
        uint64_t backing_files
        uint64_t kept_backings
        uint64_t opened
        uint64_t spliced
        uint64_t max_read
        uint64_t peer_names
        uint64_t peer_answers
        uint64_t peer_bytes
        uint64_t peer_checked
        uint64_t peer_routes
        uint64_t peer_sent
        uint64_t peer_reads
        uint64_t peer_read_bytes
        uint64_t peer_handbacks
        uint64_t peer_refused
    ctypedef struct cfr_peer_result:
        size_t consumed
        size_t answered
        uint64_t *plain_inos
        size_t plain
        int partial_fd
        const unsigned char *partial_head
        size_t partial_head_len
        uint64_t partial_sent
        uint64_t partial_length
        int error
    int cfr_register_peer_name(uint64_t ino, const unsigned char *name, size_t len)
    int cfr_peer_answer(int sock, const unsigned char *frames, size_t len, size_t max_answers,
                        cfr_peer_result *out)
    void cfr_configure(uint64_t chunk_size, uint64_t max_blocks, uint64_t max_dentries)
    int cfr_register(uint64_t ino, uint64_t index, uint64_t block_size, uint64_t file_size,
                     uint64_t file_id, const char *path, uint64_t length,
                     const unsigned char *sums, size_t sums_len, uint64_t written_ino,
                     int64_t written_ctime_ns)
    int cfr_register_dentry(uint64_t parent, const char *name, size_t name_len,
                            const fuse_entry_param *entry)
    int cfr_try_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
    void cfr_forget_file(uint64_t file_id)
    void cfr_forget_inodes(uint64_t lo, uint64_t hi)
    void cfr_clear()
    void cfr_get_stats(cfr_stats_t *out)
    int cfr_try_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off)
    int cfr_try_peer_read(fuse_req_t req, fuse_ino_t ino, uint64_t fh, size_t size, off_t off)
    int cfr_fd_readable(int fd, int wait_us) nogil
    int cfr_fd_ready(int fd)
    void cfr_count_batch(int requests)
    void cfr_count_unwaited()
    int cfr_register_listing(uint64_t dir, const unsigned char *packed, size_t len,
                             uint64_t count)
    void cfr_configure_listings(uint64_t max_bytes, double entry_timeout, double attr_timeout)
    int cfr_try_readdirplus(fuse_req_t req, uint64_t dir, size_t size, off_t off)
    int cfr_try_opendir(fuse_req_t req, uint64_t dir, fuse_file_info *fi)
    int cfr_try_releasedir(fuse_req_t req)
    void cfr_set_cache_listings(int on)
    void cfr_mark_listing(fuse_file_info *fi)
    void cfr_init_connection(fuse_conn_info *conn)
    void cfr_want_passthrough(int on)
    void cfr_process_buf(fuse_session *se, const fuse_buf *buf, int fd)
    int cfr_try_open(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi)
    int cfr_try_release(fuse_req_t req, fuse_ino_t ino)
    size_t cfr_init_request(unsigned char *out, size_t cap)
    int cfr_replay_init(fuse_session *se, const unsigned char *request, size_t len)
    enum: CFR_INIT_REQUEST_MAX

#: True: this pyfuse3 answers READs of registered blocks in C.
FAST_READ = True
#: Requests the session loop takes from /dev/fuse in a row, while each is answered in C,
#: before it goes back to trio (so other tasks still run under a stream of fast reads) ...
cdef int FAST_BATCH = 128
#: ... each waited for at most this long, without the GIL (other threads run meanwhile): a
#: reader that reads file after file sends its next READ within tens of microseconds, and
#: waiting here for it costs less than a trip through trio's scheduler (measured with 16
#: readers: ~20 READs per return to trio). A batch holds the trio loop for its waits, at most
#: FAST_BATCH * FAST_WAIT_US (12.8 ms), plus its reads: ~100 us per 1 MiB READ.
cdef int FAST_WAIT_US = 100
#: Requests a session task back from a Python handler reads in a row without waiting for
#: /dev/fuse (one already queued each time) before it waits through trio again, letting other
#: tasks run.
cdef int UNWAITED_IN_A_ROW = 16


cdef inline int fast_request_waiting(int fd) noexcept:
    '''Whether a request arrives within FAST_WAIT_US, waited for without the GIL.'''
    cdef int readable
    with nogil:
        readable = cfr_fd_readable(fd, FAST_WAIT_US)
    return readable


cdef int register_listing_now(uint64_t dir_inode) noexcept:
    '''Let cachefs register a directory's whole listing now (``operations.native_listing``, a
    plain call: nothing runs between its snapshot read and the registration); 1 if it did.'''
    hook = getattr(operations, 'native_listing', None)
    if hook is None:
        return 0
    try:
        return 1 if hook(dir_inode) else 0
    except Exception:
        log.exception('native_listing(%d) failed', dir_inode)
        return 0


def fast_read_configure(uint64_t chunk_size, uint64_t max_blocks, uint64_t max_dentries):
    '''Set the checksum chunk size, the most blocks the READ table keeps and the most names
    the LOOKUP table keeps (0: keep none).'''
    cfr_configure(chunk_size, max_blocks, max_dentries)


def fast_lookup_register(uint64_t parent, bytes name, EntryAttributes entry):
    '''Remember the reply to LOOKUP(parent, name); False if refused.'''
    return cfr_register_dentry(parent, name, len(name), &entry.fuse_param) == 0


def fast_read_register(uint64_t ino, uint64_t index, uint64_t block_size, uint64_t file_size,
                       uint64_t file_id, bytes path, uint64_t length, bytes chunk_sums,
                       uint64_t written_ino=0, int64_t written_ctime_ns=0):
    '''Register block ``index`` of inode ``ino``; False if refused. ``written_ino`` and
    ``written_ctime_ns``: the file's state right after cachefs wrote it (0: not known).'''
    return cfr_register(ino, index, block_size, file_size, file_id, path, length,
                        <const unsigned char *> (<const char *> chunk_sums),
                        len(chunk_sums), written_ino, written_ctime_ns) == 0


def fast_listing_configure(uint64_t max_bytes, double entry_timeout, double attr_timeout):
    '''Bound the listing table (bytes; 0: keep none) and set the timeouts of its replies.'''
    cfr_configure_listings(max_bytes, entry_timeout, attr_timeout)


def fast_listing_register(uint64_t dir_inode, bytes packed, uint64_t count):
    '''Register the whole listing of a directory (``count`` packed records, see
    cachefs_fast_read.h); False if refused.'''
    return cfr_register_listing(dir_inode, <const unsigned char *> (<const char *> packed),
                                len(packed), count) == 0


def fast_read_forget_file(uint64_t file_id):
    '''Drop every block whose cache file has this id (call before removing the file).'''
    cfr_forget_file(file_id)


def fast_read_forget_inodes(uint64_t lo, uint64_t hi):
    '''Drop every inode in [lo, hi].'''
    cfr_forget_inodes(lo, hi)


def fast_read_clear():
    cfr_clear()


def cache_listings(bint on):
    '''Let the kernel keep directory listings (FOPEN_CACHE_DIR on every OPENDIR reply) until
    the directory's inode is invalidated (invalidate_inode), or stop doing so.'''
    cfr_set_cache_listings(on)


def fast_passthrough(bint on):
    '''Ask the kernel for FUSE passthrough at the next mount's INIT (call before main()):
    granted, every OPEN and RELEASE is answered in C, and a file whose one block is in the
    table is read by the kernel from the block file (``fast_read_stats()['passthrough']``).'''
    cfr_want_passthrough(on)


def fast_read_stats():
    '''The table's counters (see cachefs_fast_read.h).'''
    cdef cfr_stats_t s
    cfr_get_stats(&s)
    return {
        'reads': s.reads, 'first_reads': s.first_reads, 'bytes': s.bytes,
        'fallbacks': s.fallbacks, 'vanished': s.vanished, 'corrupt': s.corrupt,
        'blocks': s.blocks, 'files': s.files, 'registered': s.registered,
        'refused': s.refused, 'limit_drops': s.limit_drops,
        'lookups': s.lookups, 'dentries': s.dentries, 'open_files': s.open_files,
        'batches': s.batches, 'batched': s.batched, 'unwaited': s.unwaited,
        'readdirs': s.readdirs, 'opendirs': s.opendirs, 'listings': s.listings,
        'listing_bytes': s.listing_bytes,
        'passthrough': s.passthrough, 'pt_opens': s.pt_opens,
        'cached_opens': s.cached_opens, 'pt_refused': s.pt_refused,
        'backing_files': s.backing_files, 'kept_backings': s.kept_backings,
        'opened': s.opened, 'spliced': s.spliced, 'max_read': s.max_read,
        'peer_names': s.peer_names, 'peer_answers': s.peer_answers,
        'peer_bytes': s.peer_bytes, 'peer_checked': s.peer_checked,
        'peer_routes': s.peer_routes, 'peer_sent': s.peer_sent, 'peer_reads': s.peer_reads,
        'peer_read_bytes': s.peer_read_bytes, 'peer_handbacks': s.peer_handbacks,
        'peer_refused': s.peer_refused,
    }


#: The most peer requests fast_peer_answer() answers in one call.
cdef size_t PEER_ANSWERS_MAX = 64


def fast_peer_register(uint64_t ino, bytes name):
    '''Register the bytes a peer's request for inode ``ino`` carries (cachefs_fast_read.h); False
    if refused (the inode has no blocks in the table).'''
    return cfr_register_peer_name(ino, <const unsigned char *> (<const char *> name),
                                  len(name)) == 0


def fast_peer_answer(int sock_fd, frames, size_t max_answers):
    '''Answer on the non-blocking socket ``sock_fd`` the peer request frames at the start of
    ``frames`` (a buffer) whose blocks are in the table, at most ``max_answers`` (and at most
    PEER_ANSWERS_MAX): ``(consumed, answered, plain_inos, partial)``, ``partial`` None or
    ``(head, fd, length, sent)`` for an answer the socket did not take whole (``fd`` is the
    caller's to close). OSError when a send failed: the connection must close.'''
    cdef Py_buffer view
    cdef uint64_t inos[64]
    cdef cfr_peer_result r
    cdef int failed
    if max_answers > PEER_ANSWERS_MAX:
        max_answers = PEER_ANSWERS_MAX
    r.plain_inos = inos
    # The plain buffer protocol (not a typed memoryview, whose utility code breaks the module's
    # init when compiled into pyfuse3's __init__.pyx).
    PyObject_GetBuffer(frames, &view, PyBUF_SIMPLE)
    try:
        failed = cfr_peer_answer(sock_fd, <const unsigned char *> view.buf, <size_t> view.len,
                                 max_answers, &r)
    finally:
        PyBuffer_Release(&view)
    partial = None
    if r.partial_fd >= 0:
        partial = (r.partial_head[:r.partial_head_len], r.partial_fd, r.partial_length,
                   r.partial_sent)
    if failed:
        if r.partial_fd >= 0:
            os.close(r.partial_fd)
        raise OSError(r.error, os.strerror(r.error))
    return r.consumed, r.answered, [inos[i] for i in range(r.plain)], partial


# --- clones: further serving processes on the mounted connection ("clones" in
# cachefs_fast_read.c; cachefs/fs/serving.py runs them) ---------------------------------------

def session_descriptor():
    '''This process's /dev/fuse descriptor of its session (-1 before init()); cachefs clones it
    (FUSE_DEV_IOC_CLONE) for its serving processes.'''
    return session_fd if session != NULL else -1


def init_request():
    '''The FUSE_INIT request the kernel sent this session, as it came (b'' before it came).'''
    cdef unsigned char buf[CFR_INIT_REQUEST_MAX]
    cdef size_t n = cfr_init_request(buf, CFR_INIT_REQUEST_MAX)
    return (<char *> buf)[:n]


def init_clone(ops, int fd, bytes request, options):
    '''Serve another process's mounted connection through ``fd``, a clone of its /dev/fuse
    descriptor: a session as init() makes, with no mount of its own ("/dev/fd/N"), brought into
    the state that mount's FUSE_INIT gave it by processing ``request`` (that mount's
    init_request()). Then main() serves it; close(unmount=False) ends it. RuntimeError when
    libfuse did not take the request.'''
    init(ops, '/dev/fd/%d' % fd, options)
    if cfr_replay_init(session, <const unsigned char *> (<const char *> request),
                       len(request)) != 0:
        raise RuntimeError('the FUSE_INIT request did not initialise the clone\'s session')
