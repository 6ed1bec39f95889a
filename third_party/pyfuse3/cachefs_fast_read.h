/* cachefs's native READ fast path, compiled into pyfuse3 by third_party/pyfuse3/build.py.
 *
 * A table, filled and emptied by cachefs (Python), says where the verified bytes of a file's
 * cached blocks are: (inode, block index) -> block file path, length, chunk checksums. pyfuse3's
 * fuse_read() first offers each READ to cfr_try_read(): when every block the request touches
 * is in the table, the request is answered here without a Python handler or a trio task: from
 * the block files (kept open in a bounded list), read and checked (pread, an xxh3 check of
 * every chunk read, fuse_reply_buf) or, for chunks of a tmpfs block file that passed their
 * check while the file was as it is now (or that the cache wrote it with, in that state),
 * spliced to /dev/fuse without a copy through the
 * worker (the reply written here, reply_spliced());
 * otherwise (or on any error or checksum mismatch) it returns 0 and the request goes to
 * cachefs's Python handler unchanged.
 * The rules that keep the table coherent with the cache are in cachefs_fast_read.c.
 */
#ifndef CACHEFS_FAST_READ_H
#define CACHEFS_FAST_READ_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <fuse_lowlevel.h>

typedef struct {
    uint64_t reads;        /* READs answered here */
    uint64_t first_reads;  /* ... of them at offset 0 (a file's first READ) */
    uint64_t bytes;        /* bytes replied by them */
    uint64_t fallbacks;    /* READs of a registered inode handed to Python (block missing) */
    uint64_t vanished;     /* blocks dropped from the table: file gone or short */
    uint64_t corrupt;      /* blocks dropped from the table: a chunk failed its checksum */
    uint64_t blocks;       /* blocks in the table now */
    uint64_t files;        /* inodes in the table now */
    uint64_t registered;   /* registrations accepted since start */
    uint64_t refused;      /* registrations refused (inconsistent, or too many blocks) */
    uint64_t limit_drops;  /* blocks pushed out of the table by its size limit */
    uint64_t lookups;      /* LOOKUPs answered here */
    uint64_t dentries;     /* names in the lookup table now */
    uint64_t open_files;   /* block files held open now (at most a bounded number) */
    uint64_t batches;      /* times the session loop went back to trio after a request */
    uint64_t batched;      /* requests it took from /dev/fuse before those returns */
    uint64_t unwaited;     /* requests a session task read without waiting through trio */
    uint64_t readdirs;     /* READDIRPLUS requests answered here */
    uint64_t opendirs;     /* OPENDIRs answered here */
    uint64_t listings;     /* directory listings in the listing table now */
    uint64_t listing_bytes; /* ... and the memory they take */
    uint64_t passthrough;  /* 1 when the kernel granted FUSE passthrough at INIT */
    uint64_t pt_opens;     /* OPENs answered with the block file handed to the kernel */
    uint64_t cached_opens; /* OPENs answered for reads through READ requests */
    uint64_t pt_refused;   /* block files the kernel refused as backing files */
    uint64_t backing_files; /* backing files registered with the kernel now ... */
    uint64_t kept_backings; /* ... of them kept by blocks in the table for their next opens */
    uint64_t opened;       /* inodes with OPENs not yet RELEASEd now */
    uint64_t spliced;      /* READs (of `reads`) spliced from chunks checked before */
    uint64_t max_read;     /* the largest READ this connection asked for (0 before INIT) */
    uint64_t peer_names;   /* files in the table answerable to peers (cfr_register_peer_name) */
    uint64_t peer_answers; /* peer block requests answered here (cfr_peer_answer) */
    uint64_t peer_bytes;   /* ... the bytes of their blocks */
    uint64_t peer_checked; /* ... of them read and checked first (not checked in this state) */
    uint64_t peer_routes;  /* inodes whose READs are sent to their owner from here, now */
    uint64_t peer_sent;    /* READs sent to an owner from here (cfr_try_peer_read) */
    uint64_t peer_reads;   /* ... answered from its checked answer */
    uint64_t peer_read_bytes; /* ... the bytes replied */
    uint64_t peer_handbacks; /* ... handed back to Python (refused, a fault, a timeout) */
    uint64_t peer_refused; /* ... of them because the owner declined (the route is dropped) */
} cfr_stats_t;

/* Chunk size of the checksums (cachefs.cache.base.CHUNK_SIZE), the most blocks kept and the
 * most names kept in the lookup table. */
void cfr_configure(uint64_t chunk_size, uint64_t max_blocks, uint64_t max_dentries);

/* Register block `index` of inode `ino`: `length` bytes at offset 0 of the file at `path`,
 * whose chunks have the big-endian xxh3_64 digests `sums` (8 bytes each). `written_ino` and
 * `written_ctime_ns`, when not 0: the file's inode number and ctime right after cachefs wrote
 * it from the bytes the digests were computed from; while the file stays in that state its
 * chunks count as checked (spliced without a read, see note_checked()). Returns 0 when kept,
 * -1 when refused (inconsistent sizes, no room for its file's block array, out of memory). */
int cfr_register(uint64_t ino, uint64_t index, uint64_t block_size, uint64_t file_size,
                 uint64_t file_id, const char *path, uint64_t length,
                 const unsigned char *sums, size_t sums_len, uint64_t written_ino,
                 int64_t written_ctime_ns);

/* Remember the reply to LOOKUP(parent, name) (what cachefs answered in Python), so that the
 * next LOOKUP of that name, after the kernel dropped its dentry, is answered here. */
int cfr_register_dentry(uint64_t parent, const char *name, size_t name_len,
                        const struct fuse_entry_param *entry);
/* Answer a LOOKUP from the table: 1 when replied, 0 to fall through. */
int cfr_try_lookup(fuse_req_t req, fuse_ino_t parent, const char *name);

/* Register the whole listing of directory `dir`: `count` packed records (little-endian: ino,
 * resume offset, size, mtime_ns as 8 bytes each; mode, nlink, uid, gid as 4; name length as 2;
 * then the name). 0 when kept, -1 when refused (malformed, or larger than a quarter of the
 * table's bound). */
int cfr_register_listing(uint64_t dir, const unsigned char *packed, size_t len, uint64_t count);
/* The listing table's bound in bytes, and the timeouts its READDIRPLUS replies give. */
void cfr_configure_listings(uint64_t max_bytes, double entry_timeout, double attr_timeout);
/* Answer a READDIRPLUS from the listing table: 1 when replied, 0 to fall through. */
int cfr_try_readdirplus(fuse_req_t req, uint64_t dir, size_t size, off_t off);
/* Answer OPENDIR of a directory whose listing is in the table, and RELEASEDIR while the table
 * is on (cachefs keeps nothing per open directory): 1 when replied, 0 to fall through. */
int cfr_try_opendir(fuse_req_t req, uint64_t dir, struct fuse_file_info *fi);
int cfr_try_releasedir(fuse_req_t req);

/* Drop every block whose cache file has this id (called before the file is removed). */
void cfr_forget_file(uint64_t file_id);
/* Drop every inode in [lo, hi], every name under a directory in [lo, hi] or naming an inode
 * in it, and the listings of directories in it (a dataset removed or its snapshot swapped). */
void cfr_forget_inodes(uint64_t lo, uint64_t hi);
void cfr_clear(void);
void cfr_get_stats(cfr_stats_t *out);

/* Answer a READ if every byte it asks for is in the table: 1 when replied, 0 to fall through. */
int cfr_try_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off);

/* Directory listings: when on, OPENDIR replies let the kernel keep a directory's listing
 * (FOPEN_CACHE_DIR + keep_cache) until cachefs invalidates the directory's inode. */
void cfr_set_cache_listings(int on);
void cfr_mark_listing(struct fuse_file_info *fi);

/* Peer answers (see "peer answers" in the .c file). Register the bytes a peer's request for
 * inode `ino` carries: the request head's dataset, etag and key lengths and file size (its bytes
 * 6..22), its block size (bytes 30..34), then the dataset name, etag and key (the request's
 * names). The inode must have blocks in the table; the name goes when they all go. 0 when kept,
 * -1 when refused. */
int cfr_register_peer_name(uint64_t ino, const unsigned char *name, size_t len);

typedef struct {
    size_t consumed;         /* bytes of the frames answered (whole frames) */
    size_t answered;         /* answers sent, the last one perhaps in part (partial_fd) */
    uint64_t *plain_inos;    /* the caller's room for max_answers inodes: ... */
    size_t plain;            /* ... those of the answers to requests that were not cached-only */
    int partial_fd;          /* >= 0: the last answer is not all sent: its block file (dup) */
    const unsigned char *partial_head; /* ... its head and checksums (valid until next call) */
    size_t partial_head_len;
    uint64_t partial_sent;   /* ... bytes of head, checksums and block sent */
    uint64_t partial_length; /* ... the block's length */
    int error;               /* the errno of a send that failed: the connection must close */
} cfr_peer_result;

/* Answer, on the non-blocking socket `sock`, the request frames at the start of `frames` whose
 * blocks are in the table, in order, at most `max_answers`; stops at the first it cannot
 * answer (the caller handles that one), at an incomplete frame, or when the socket is full.
 * 0, or -1 when a send failed (out->error; the connection must close). */
int cfr_peer_answer(int sock, const unsigned char *frames, size_t len, size_t max_answers,
                    cfr_peer_result *out);

/* Peer reads (see "peer reads" in the .c file): READs of a file whose one block another
 * worker owns, sent to it from here on a connection cachefs handed over. */
#define CFR_PEER_PENDING_MAX 1024 /* READs in flight on one connection (and handed back at once) */
/* Why a connection is closed (cfr_peer_receive()'s result; 0: it is fine). */
enum {
    CFR_PEER_CLOSED = 1,      /* not open (never, or closed already) */
    CFR_PEER_ENDED = 2,       /* the owner closed the connection */
    CFR_PEER_RECV_FAILED = 3, /* a receive failed */
    CFR_PEER_SEND_FAILED = 4, /* a send failed, or took part of a frame */
    CFR_PEER_GARBAGE = 5,     /* an answer no request could have (bad framing, a huge length) */
    CFR_PEER_BAD_ANSWER = 6,  /* a wrong length, chunk size or checksum */
};
/* A READ handed back: cachefs serves it in Python as if it had just come. */
typedef struct {
    fuse_req_t req;
    uint64_t fh, size;
    int64_t off;
} cfr_peer_handback;

/* Take the handshaken, non-blocking socket `fd` (still the caller's to close, after
 * cfr_peer_close()) for READs of blocks up to `max_length` bytes: its slot, or -1 if all are
 * taken. */
int cfr_peer_open(int fd, uint64_t max_length);
/* How many connections can be open at once (the slots cfr_peer_open() hands out). */
int cfr_peer_slots(void);
/* READs of inode `ino` the table cannot answer go to slot's owner as `frame` (a request of
 * the whole block, `length` bytes: the file's one block; the id in its first 4 bytes is set
 * per send). 0 when kept, -1 when refused (the slot is closed or broken, a block too large). */
int cfr_register_peer_route(uint64_t ino, int slot, const unsigned char *frame, size_t len,
                            uint64_t length);
/* Send the READ to its owner if the inode has a route: 1 when sent (answered later), 0 to
 * fall through. */
int cfr_try_peer_read(fuse_req_t req, fuse_ino_t ino, uint64_t fh, size_t size, off_t off);
/* Read and handle the answers waiting on the slot's socket: each checked answer replied to
 * its READ; the READs to hand back in `out` (room for CFR_PEER_PENDING_MAX), their number in
 * `handed`. 0 while the connection is fine (`pending` READs wait, the oldest sent
 * `oldest_age_ns` ago), else why it is closed now (its pending READs are in `out`). */
int cfr_peer_receive(int slot, cfr_peer_handback *out, size_t *handed, uint64_t *pending,
                     int64_t *oldest_age_ns);
/* Close the slot: its pending READs into `out` (or, `fail`, answered EIO). */
void cfr_peer_close(int slot, int fail, cfr_peer_handback *out, size_t *handed);

/* Called from FUSE_INIT: the connection's limits on requests in flight (see the .c file). */
void cfr_init_connection(struct fuse_conn_info *conn);

/* FUSE passthrough (kernel >= 6.9; see "passthrough" in the .c file). Ask for it before the
 * mount (`on` 1); cfr_process_buf() then negotiates it in FUSE_INIT, which libfuse 3.14 cannot,
 * and hands every other request to fuse_session_process_buf() unchanged. Once granted, every
 * OPEN and RELEASE of a file is answered here: a file whose one block is in the table and
 * checks out is handed to the kernel, which reads the block file itself (no READ reaches
 * user space); any other file is opened for READ requests, served as without passthrough. */
void cfr_want_passthrough(int on);
/* Every request read from `fd` is processed through here: a READ is remembered while it is
 * processed, so that a spliced reply can be written here whole (reply_spliced() in the .c
 * file). */
void cfr_process_buf(struct fuse_session *se, const struct fuse_buf *buf, int fd);

/* Clones (see "clones" in the .c file): the FUSE_INIT request this session processed (its
 * length; 0 before INIT, or where `cap` is too small) and, in a session reading a clone of that
 * connection's /dev/fuse, the same request processed again so that libfuse serves it (0, or -1
 * when the request is not an INIT or libfuse did not initialise). */
#define CFR_INIT_REQUEST_MAX 512
size_t cfr_init_request(unsigned char *out, size_t cap);
int cfr_replay_init(struct fuse_session *se, const unsigned char *request, size_t len);
int cfr_try_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi);
int cfr_try_release(fuse_req_t req, fuse_ino_t ino);

/* 1 if `fd` has data to read within `wait_us` microseconds (0: right now). */
int cfr_fd_readable(int fd, int wait_us);
/* Whether a read of fd would return now: a request is queued, or the connection ended. */
int cfr_fd_ready(int fd);
/* Count one return of the session loop to trio, after `requests` requests. */
void cfr_count_batch(int requests);
/* Count one request a session task read at once, without waiting through trio. */
void cfr_count_unwaited(void);

#endif
