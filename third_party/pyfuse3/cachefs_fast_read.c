/* cachefs's native READ fast path (see cachefs_fast_read.h for what it is).
 *
 * Coherence rules (what makes "never a wrong byte" hold; cachefs/fs/native_reads.py keeps the
 * Python side of them):
 *  1. A block enters the table only from cachefs, after the cache admitted it and stored its
 *     chunk checksums, and only for the snapshot generation it was looked up in.
 *  2. Every chunk a READ answered here serves has passed its checksum, or is in the state the
 *     cache wrote it in from the bytes its checksums were computed from: checked by this READ
 *     (read into memory, then replied), or by an earlier READ while the block file was in the
 *     state it is in now (same inode, ctime and size; any write moves the ctime), in which case
 *     it is spliced from the file to /dev/fuse, without a copy through the worker (see
 *     note_checked()); a block cachefs registers with the state its admission wrote the file
 *     in (the checksums were computed from the bytes written) counts as checked in that state.
 *     The latter only where nothing but a write can change a file's bytes:
 *     block files on tmpfs (the RAM tier), or any with passthrough asked for
 *     (cfr_want_passthrough()), whose backing files the kernel reads as they are between
 *     checks (see serves_checked()). A file that is gone, short or fails a checksum drops the
 *     block and hands the READ to Python, which drops the block from the cache and fetches it
 *     again.
 *  3. Before the cache removes a block file (eviction, dataset removal, cleanup, hand-off trims,
 *     promotion), cachefs calls cfr_forget_file(); before a snapshot swap or a dataset removal
 *     becomes visible, cfr_forget_inodes() over the dataset's inodes. Both take the table's
 *     mutex, which a READ holds from its lookup to its close(): once they return, no READ has
 *     the file open or can open it again, so the file's space is released when it is unlinked
 *     and a refreshed file is never served from its old blocks.
 *  4. Bounded: a block's file is opened by its first READ and kept open for the next ones, but
 *     at most max_open_fds files are open at once (the least recently read is closed first;
 *     see open_fd_bound()), so the table never nears the process's fd limit however many
 *     blocks it holds; a forget closes the file (rule 3), so an evicted block's space is never
 *     held by a descriptor of ours. The table's memory is bounded by cfr_configure()'s
 *     max_blocks (the oldest registration goes first) and by the block arrays of the files
 *     they belong to, which hold at most ARRAY_SLOTS_PER_BLOCK * max_blocks slots in all
 *     (older blocks go first to make room for a new file's array).
 */
#define _GNU_SOURCE
#include "cachefs_fast_read.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* libxxhash as Debian builds it: XXH3_64bits_dispatch picks AVX2 (or AVX-512) at run time,
 * about twice as fast as the SSE2 code a portable inline build compiles to (8 vs 16 us for a
 * 110 KB file on the reference machine): the checksum is a third of a native READ's own work. */
#include <xxhash.h>
#if defined(__x86_64__) && __has_include(<xxh_x86dispatch.h>)
#include <xxh_x86dispatch.h>
#define CFR_XXH3_64 XXH3_64bits_dispatch
#else
#define CFR_XXH3_64 XXH3_64bits
#endif

#define TMPFS_MAGIC 0x01021994 /* <linux/magic.h>: the RAM tier's filesystem */
/* A file with more blocks than this is never registered (its block array would be huge). */
#define MAX_FILE_BLOCKS (1u << 16)
/* The block arrays of all files in the table hold at most this many slots per max_blocks. */
#define ARRAY_SLOTS_PER_BLOCK 4
/* Asynchronous requests (readahead READs) the kernel may keep in flight (see
 * cfr_init_connection()). */
#define CFR_MAX_BACKGROUND 256
/* Most block files kept open at once (fewer when the fd limit is low: see open_fd_bound()). */
#define MAX_OPEN_FDS 4096

typedef struct cfr_file cfr_file;
struct cfr_block;
struct cfr_opened;
static void drop_backing(struct cfr_block *b);

typedef struct cfr_block {
    cfr_file *file;
    uint64_t index;
    uint64_t length;
    uint64_t file_id;
    struct cfr_block *next_by_id; /* chain of the by-file-id table */
    struct cfr_block *older;      /* age list: the size limit drops the oldest */
    struct cfr_block *newer;
    uint64_t nchunks;
    uint64_t *sums;               /* host order, nchunks of them */
    char *path;
    int fd;                       /* the open block file, or -1 */
    int on_tmpfs;                 /* -1 until its file is first opened; then whether on tmpfs */
    int32_t backing_id;           /* its kernel backing-file id (passthrough), or 0 ... */
    uint64_t backing_ino;         /* ... made of the file with this inode number */
    int64_t checked_ctime_ns;     /* the file's ctime and inode number when the chunks in */
    uint64_t checked_ino;         /* `checked` passed their checksums (see note_checked()) */
    uint64_t *checked;            /* bitmap: chunk k passed its checksum in that state */
    struct cfr_opened *opened;    /* the open files reading through that backing file */
    struct cfr_block *bk_older;   /* blocks with a backing file: the bound drops the least */
    struct cfr_block *bk_newer;   /* recently opened first */
    struct cfr_block *fd_older;   /* open-file list: the bound closes the least recent */
    struct cfr_block *fd_newer;
} cfr_block;

struct cfr_file {
    uint64_t ino;
    uint64_t block_size;
    uint64_t file_size;
    uint64_t nblocks;
    uint64_t held;                /* blocks of it in the table */
    cfr_file *next_by_ino;        /* chain of the by-inode table */
    cfr_file *prev_all, *next_all;
    unsigned char *peer_name;     /* the file's name in peer requests, or NULL (see "peer */
    size_t peer_name_len;         /* answers" below) ... */
    uint64_t peer_hash;           /* ... its hash ... */
    cfr_file *next_by_peer;       /* ... and the chain of the by-peer-name table */
    cfr_block *blocks[];          /* nblocks slots, NULL where not registered */
};

typedef struct {
    void **slots;
    uint64_t mask;                /* slot count - 1 (a power of two), or 0 before first use */
} table_t;

/* A remembered LOOKUP reply. */
typedef struct cfr_dentry {
    uint64_t parent;
    uint64_t hash;
    struct cfr_dentry *next;       /* chain of the by-name table */
    struct cfr_dentry *older, *newer;
    struct fuse_entry_param entry;
    size_t name_len;
    char name[];
} cfr_dentry;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t chunk_size = 128 << 10;
static uint64_t max_blocks = 1 << 18;
static table_t by_ino, by_id, by_name;
static uint64_t max_dentries = 1 << 18;
static cfr_dentry *oldest_dentry, *newest_dentry;
static cfr_file *all_files;
static cfr_block *oldest, *newest;
static cfr_stats_t stats;
static uint64_t array_slots; /* sum of nblocks over the files in the table */
static unsigned char *out_buf, *scratch_buf;
static int reserve(unsigned char **buf, size_t *cap, size_t need);
static void forget_routes(uint64_t lo, uint64_t hi);
void cfr_mark_listing(struct fuse_file_info *fi);
static size_t out_cap, scratch_cap;
static cfr_block *oldest_open, *newest_open;
static uint64_t open_fds, max_open_fds;
static int splice_granted; /* libfuse splices replies on this connection (reply_spliced()) */
static int connection_initialised; /* cfr_init_connection() ran ("clones") */
static uint64_t largest_spliced_read(void);
static int passthrough_wanted; /* cfr_want_passthrough(); also splice off tmpfs (rule 2) */
/* The READ this thread is processing (cfr_process_buf()), for a reply written here rather
 * than by libfuse (reply_spliced()): its id, the descriptor it was read from (a serving
 * process's clone of /dev/fuse: the reply must go back on it), and its inode and offset, which
 * the reply checks against the READ it answers. unique 0: no READ being processed. */
static __thread struct {
    uint64_t unique, nodeid, offset;
    int fd;
} current_read = {0, 0, 0, -1};

/* The kernel's structures, as in linux/fuse.h (7.40+), which Debian 12's headers predate. */
struct cfr_in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};
struct cfr_init_in {
    uint32_t major, minor, max_readahead, flags, flags2;
};
struct cfr_out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};

/* 64-bit words of a block's `checked` bitmap (a bit per chunk). */
static inline uint64_t checked_words(uint64_t nchunks) {
    return (nchunks + 63) / 64;
}

static inline uint64_t slot_of(const table_t *t, uint64_t key) {
    key ^= key >> 33; /* every bit counts: inodes differ in their high bits (dataset slots) */
    key *= 0xFF51AFD7ED558CCDull;
    key ^= key >> 33;
    return key & t->mask;
}

/* ---- the block tables: by inode and by cache file id (chained; they grow, never shrink) ---- */

static cfr_file *find_file(fuse_ino_t ino) {
    if (!by_ino.mask) return NULL;
    for (cfr_file *f = by_ino.slots[slot_of(&by_ino, ino)]; f; f = f->next_by_ino)
        if (f->ino == ino) return f;
    return NULL;
}

static int grow(table_t *t, uint64_t count, int is_files) {
    if (t->mask && count <= t->mask + 1) return 0;
    uint64_t size = t->mask ? (t->mask + 1) * 2 : 1024;
    void **slots = calloc(size, sizeof(void *));
    if (!slots) return -1;
    table_t bigger = {slots, size - 1};
    for (uint64_t i = 0; t->mask && i <= t->mask; i++) {
        void *item = t->slots[i];
        while (item) {
            void *next;
            uint64_t s;
            if (is_files) {
                cfr_file *f = item;
                next = f->next_by_ino;
                s = slot_of(&bigger, f->ino);
                f->next_by_ino = slots[s];
            } else {
                cfr_block *b = item;
                next = b->next_by_id;
                s = slot_of(&bigger, b->file_id);
                b->next_by_id = slots[s];
            }
            slots[s] = item;
            item = next;
        }
    }
    free(t->slots);
    *t = bigger;
    return 0;
}

static void unlink_peer_name(cfr_file *f);

static void unlink_file(cfr_file *f) {
    unlink_peer_name(f);
    cfr_file **p = (cfr_file **)&by_ino.slots[slot_of(&by_ino, f->ino)];
    while (*p != f) p = &(*p)->next_by_ino;
    *p = f->next_by_ino;
    if (f->prev_all) f->prev_all->next_all = f->next_all;
    else all_files = f->next_all;
    if (f->next_all) f->next_all->prev_all = f->prev_all;
    stats.files--;
    array_slots -= f->nblocks;
    free(f);
}

/* ---- open block files (a bounded list, least recently read first) ---- */

static uint64_t open_fd_bound(void) {
    if (!max_open_fds) { /* a quarter of the soft fd limit, at most MAX_OPEN_FDS */
        struct rlimit limit;
        max_open_fds = MAX_OPEN_FDS;
        if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY &&
            limit.rlim_cur / 4 < max_open_fds)
            max_open_fds = limit.rlim_cur / 4 ? limit.rlim_cur / 4 : 1;
    }
    return max_open_fds;
}

static void unlist_fd(cfr_block *b) {
    if (b->fd_older) b->fd_older->fd_newer = b->fd_newer;
    else oldest_open = b->fd_newer;
    if (b->fd_newer) b->fd_newer->fd_older = b->fd_older;
    else newest_open = b->fd_older;
    b->fd_older = b->fd_newer = NULL;
}

static void list_fd_newest(cfr_block *b) {
    b->fd_newer = NULL;
    b->fd_older = newest_open;
    if (newest_open) newest_open->fd_newer = b;
    else oldest_open = b;
    newest_open = b;
}

static void close_fd(cfr_block *b) {
    if (b->fd < 0) return;
    unlist_fd(b);
    close(b->fd);
    b->fd = -1;
    open_fds--;
}

/* The block's file, open; -1 with errno set when it cannot be opened. */
static int block_fd(cfr_block *b) {
    if (b->fd >= 0) {
        if (newest_open != b) {
            unlist_fd(b);
            list_fd_newest(b);
        }
        return b->fd;
    }
    while (open_fds >= open_fd_bound() && oldest_open) close_fd(oldest_open);
    int fd = open(b->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    b->fd = fd;
    open_fds++;
    list_fd_newest(b);
    return fd;
}

static void remove_block(cfr_block *b) {
    close_fd(b); /* before the cache may unlink the file: its space goes with the unlink */
    drop_backing(b); /* ... and so does its backing file, once no open file reads it */
    cfr_block **p = (cfr_block **)&by_id.slots[slot_of(&by_id, b->file_id)];
    while (*p != b) p = &(*p)->next_by_id;
    *p = b->next_by_id;
    if (b->older) b->older->newer = b->newer;
    else oldest = b->newer;
    if (b->newer) b->newer->older = b->older;
    else newest = b->older;
    cfr_file *f = b->file;
    f->blocks[b->index] = NULL;
    stats.blocks--;
    free(b);
    if (--f->held == 0) unlink_file(f);
}

static void remove_file(cfr_file *f) {
    for (uint64_t i = 0; i < f->nblocks && f->held > 1; i++)
        if (f->blocks[i]) remove_block(f->blocks[i]);
    for (uint64_t i = 0; i < f->nblocks; i++)
        if (f->blocks[i]) { remove_block(f->blocks[i]); return; } /* frees f */
}

/* ---- the lookup table ---- */

static uint64_t name_hash(uint64_t parent, const char *name, size_t len) {
    return XXH3_64bits_withSeed(name, len, parent);
}

static void remove_dentry(cfr_dentry *d) {
    cfr_dentry **p = (cfr_dentry **)&by_name.slots[slot_of(&by_name, d->hash)];
    while (*p != d) p = &(*p)->next;
    *p = d->next;
    if (d->older) d->older->newer = d->newer;
    else oldest_dentry = d->newer;
    if (d->newer) d->newer->older = d->older;
    else newest_dentry = d->older;
    stats.dentries--;
    free(d);
}

static cfr_dentry *find_dentry(uint64_t parent, const char *name, size_t len, uint64_t hash) {
    if (!by_name.mask) return NULL;
    for (cfr_dentry *d = by_name.slots[slot_of(&by_name, hash)]; d; d = d->next)
        if (d->hash == hash && d->parent == parent && d->name_len == len &&
            memcmp(d->name, name, len) == 0)
            return d;
    return NULL;
}

static int grow_dentries(void) {
    if (by_name.mask && stats.dentries + 1 <= by_name.mask + 1) return 0;
    uint64_t size = by_name.mask ? (by_name.mask + 1) * 2 : 1024;
    void **slots = calloc(size, sizeof(void *));
    if (!slots) return -1;
    table_t bigger = {slots, size - 1};
    for (cfr_dentry *d = oldest_dentry; d; d = d->newer) {
        uint64_t s = slot_of(&bigger, d->hash);
        d->next = slots[s];
        slots[s] = d;
    }
    free(by_name.slots);
    by_name = bigger;
    return 0;
}

int cfr_register_dentry(uint64_t parent, const char *name, size_t name_len,
                        const struct fuse_entry_param *entry) {
    uint64_t hash = name_hash(parent, name, name_len);
    cfr_dentry *d = malloc(sizeof(*d) + name_len);
    if (!d) return -1;
    d->parent = parent;
    d->hash = hash;
    d->entry = *entry;
    d->name_len = name_len;
    memcpy(d->name, name, name_len);
    pthread_mutex_lock(&lock);
    if (max_dentries == 0 || grow_dentries() != 0) {
        pthread_mutex_unlock(&lock);
        free(d);
        return -1;
    }
    cfr_dentry *old = find_dentry(parent, name, name_len, hash);
    if (old) remove_dentry(old);
    uint64_t s = slot_of(&by_name, hash);
    d->next = by_name.slots[s];
    by_name.slots[s] = d;
    d->newer = NULL;
    d->older = newest_dentry;
    if (newest_dentry) newest_dentry->newer = d;
    else oldest_dentry = d;
    newest_dentry = d;
    stats.dentries++;
    while (stats.dentries > max_dentries) remove_dentry(oldest_dentry);
    pthread_mutex_unlock(&lock);
    return 0;
}

int cfr_try_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    size_t len = strlen(name);
    uint64_t hash = name_hash(parent, name, len);
    struct fuse_entry_param entry;
    pthread_mutex_lock(&lock);
    cfr_dentry *d = find_dentry(parent, name, len, hash);
    if (d) {
        entry = d->entry;
        stats.lookups++;
    }
    pthread_mutex_unlock(&lock);
    if (!d) return 0;
    fuse_reply_entry(req, &entry);
    return 1;
}

/* ---- the listing table: READDIRPLUS of directories cachefs listed once ----
 *
 * Before an OPENDIR or a READDIRPLUS at offset 0 goes to Python, the binding asks cachefs to
 * register the directory's whole listing (every child's name, inode, attributes and the offset
 * the kernel resumes after it); OPENDIR and READDIRPLUS of it, at any offset cachefs gave, are
 * then answered here. Coherence: the listing is of the snapshot served when it was registered
 * (a plain call, nothing runs in between), and
 * cfr_forget_inodes() drops the listings of a dataset's directories before a snapshot swap or
 * a removal. Bounded: at most max_listing_bytes in all (the least recently used go first). */

typedef struct {
    uint64_t ino;
    uint64_t off;       /* the offset the kernel resumes after this entry */
    uint64_t size;
    int64_t mtime_ns;
    uint32_t mode, nlink, uid, gid;
    uint32_t name_at;   /* into the listing's names: NUL-terminated */
} cfr_dirent;

typedef struct cfr_listing {
    uint64_t dir;
    uint64_t count;
    uint64_t hint;                /* the entry after the last one replied (sequential reads) */
    uint64_t bytes;
    struct cfr_listing *next;     /* chain of the by-directory table */
    struct cfr_listing *older, *newer;
    char *names;
    cfr_dirent entries[];
} cfr_listing;

static table_t by_dir;
static cfr_listing *oldest_listing, *newest_listing;
static uint64_t listing_bytes, max_listing_bytes; /* 0: no listings kept (until configured) */
static double listing_entry_timeout, listing_attr_timeout;

static cfr_listing *find_listing(uint64_t dir) {
    if (!by_dir.mask) return NULL;
    for (cfr_listing *l = by_dir.slots[slot_of(&by_dir, dir)]; l; l = l->next)
        if (l->dir == dir) return l;
    return NULL;
}

/* The listings' age list: least recently used first. */
static void unlist_listing(cfr_listing *l) {
    if (l->older) l->older->newer = l->newer;
    else oldest_listing = l->newer;
    if (l->newer) l->newer->older = l->older;
    else newest_listing = l->older;
}

static void list_listing_newest(cfr_listing *l) {
    l->newer = NULL;
    l->older = newest_listing;
    if (newest_listing) newest_listing->newer = l;
    else oldest_listing = l;
    newest_listing = l;
}

static void remove_listing(cfr_listing *l) {
    cfr_listing **p = (cfr_listing **)&by_dir.slots[slot_of(&by_dir, l->dir)];
    while (*p != l) p = &(*p)->next;
    *p = l->next;
    unlist_listing(l);
    listing_bytes -= l->bytes;
    stats.listings--;
    free(l);
}

static int grow_listings(void) {
    if (by_dir.mask && stats.listings + 1 <= by_dir.mask + 1) return 0;
    uint64_t size = by_dir.mask ? (by_dir.mask + 1) * 2 : 1024;
    void **slots = calloc(size, sizeof(void *));
    if (!slots) return -1;
    table_t bigger = {slots, size - 1};
    for (cfr_listing *l = oldest_listing; l; l = l->newer) {
        uint64_t s = slot_of(&bigger, l->dir);
        l->next = slots[s];
        slots[s] = l;
    }
    free(by_dir.slots);
    by_dir = bigger;
    return 0;
}

/* The packed record cachefs sends per child (little-endian), followed by the name. */
#define LISTING_RECORD 50

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int k = 7; k >= 0; k--) v = v << 8 | p[k];
    return v;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Big-endian fields: the chunk checksums cachefs hands over, and the block protocol's. */
static uint64_t be_get(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int k = 0; k < n; k++) v = v << 8 | p[k];
    return v;
}

static void be_put(unsigned char *p, uint64_t v, int n) {
    for (int k = n - 1; k >= 0; k--, v >>= 8) p[k] = (unsigned char)v;
}

int cfr_register_listing(uint64_t dir, const unsigned char *packed, size_t len, uint64_t count) {
    /* Check the records first: a listing is used only whole. */
    size_t names_len = 0, at = 0;
    for (uint64_t i = 0; i < count; i++) {
        if (len - at < LISTING_RECORD) return -1;
        size_t name_len = (size_t)packed[at + 48] | (size_t)packed[at + 49] << 8;
        if (name_len == 0 || len - at - LISTING_RECORD < name_len) return -1;
        at += LISTING_RECORD + name_len;
        names_len += name_len + 1;
    }
    if (at != len) return -1;
    uint64_t bytes = sizeof(cfr_listing) + count * sizeof(cfr_dirent) + names_len;
    if (bytes > max_listing_bytes / 4) return -1; /* one directory may not take the table */
    cfr_listing *l = malloc(bytes);
    if (!l) return -1;
    l->dir = dir;
    l->count = count;
    l->hint = 0;
    l->bytes = bytes;
    l->names = (char *)(l->entries + count);
    at = 0;
    size_t name_at = 0;
    for (uint64_t i = 0; i < count; i++) {
        const unsigned char *r = packed + at;
        cfr_dirent *e = &l->entries[i];
        e->ino = le64(r);
        e->off = le64(r + 8);
        e->size = le64(r + 16);
        e->mtime_ns = (int64_t)le64(r + 24);
        e->mode = le32(r + 32);
        e->nlink = le32(r + 36);
        e->uid = le32(r + 40);
        e->gid = le32(r + 44);
        size_t name_len = (size_t)r[48] | (size_t)r[49] << 8;
        memcpy(l->names + name_at, r + LISTING_RECORD, name_len);
        l->names[name_at + name_len] = '\0';
        e->name_at = (uint32_t)name_at;
        name_at += name_len + 1;
        at += LISTING_RECORD + name_len;
    }
    pthread_mutex_lock(&lock);
    if (grow_listings() != 0) {
        pthread_mutex_unlock(&lock);
        free(l);
        return -1;
    }
    cfr_listing *old = find_listing(dir);
    if (old) remove_listing(old);
    while (listing_bytes + bytes > max_listing_bytes && oldest_listing)
        remove_listing(oldest_listing);
    uint64_t s = slot_of(&by_dir, dir);
    l->next = by_dir.slots[s];
    by_dir.slots[s] = l;
    list_listing_newest(l);
    listing_bytes += bytes;
    stats.listings++;
    pthread_mutex_unlock(&lock);
    return 0;
}

void cfr_configure_listings(uint64_t max_bytes, double entry_timeout, double attr_timeout) {
    pthread_mutex_lock(&lock);
    max_listing_bytes = max_bytes;
    listing_entry_timeout = entry_timeout;
    listing_attr_timeout = attr_timeout;
    while (listing_bytes > max_listing_bytes && oldest_listing) remove_listing(oldest_listing);
    pthread_mutex_unlock(&lock);
}

static unsigned char *dir_buf;
static size_t dir_cap;

/* OPENDIR of a directory whose listing is here: answered as cachefs answers it (the handle is
 * the inode; the kernel may keep the listing), without Python. */
int cfr_try_opendir(fuse_req_t req, uint64_t dir, struct fuse_file_info *fi) {
    pthread_mutex_lock(&lock);
    int known = find_listing(dir) != NULL;
    if (known) stats.opendirs++;
    pthread_mutex_unlock(&lock);
    if (!known) return 0;
    fi->fh = dir;
    cfr_mark_listing(fi);
    fuse_reply_open(req, fi);
    return 1;
}

/* RELEASEDIR: cachefs keeps nothing per open directory, so while listings are served here the
 * reply needs no Python. */
int cfr_try_releasedir(fuse_req_t req) {
    if (!max_listing_bytes) return 0;
    fuse_reply_err(req, 0);
    return 1;
}

int cfr_try_readdirplus(fuse_req_t req, uint64_t dir, size_t size, off_t off) {
    pthread_mutex_lock(&lock);
    cfr_listing *l = find_listing(dir);
    if (!l || reserve(&dir_buf, &dir_cap, size) != 0) {
        pthread_mutex_unlock(&lock);
        return 0;
    }
    uint64_t i = 0;
    if (off != 0) { /* resume after the entry whose offset is `off`: usually the hint */
        if (l->hint > 0 && l->hint <= l->count && l->entries[l->hint - 1].off == (uint64_t)off) {
            i = l->hint;
        } else {
            while (i < l->count && l->entries[i].off != (uint64_t)off) i++;
            if (i == l->count) { /* an offset this listing never gave: Python answers */
                pthread_mutex_unlock(&lock);
                return 0;
            }
            i++;
        }
    }
    size_t used = 0;
    struct fuse_entry_param e;
    memset(&e, 0, sizeof(e));
    e.entry_timeout = listing_entry_timeout;
    e.attr_timeout = listing_attr_timeout;
    for (; i < l->count; i++) {
        const cfr_dirent *d = &l->entries[i];
        e.ino = d->ino;
        e.attr.st_ino = d->ino;
        e.attr.st_mode = d->mode;
        e.attr.st_nlink = d->nlink;
        e.attr.st_uid = d->uid;
        e.attr.st_gid = d->gid;
        e.attr.st_size = (off_t)d->size;
        e.attr.st_blksize = 1 << 17;
        e.attr.st_blocks = (blkcnt_t)((d->size + 511) / 512);
        e.attr.st_atim.tv_sec = e.attr.st_mtim.tv_sec = e.attr.st_ctim.tv_sec =
            (time_t)(d->mtime_ns / 1000000000);
        e.attr.st_atim.tv_nsec = e.attr.st_mtim.tv_nsec = e.attr.st_ctim.tv_nsec =
            (long)(d->mtime_ns % 1000000000);
        size_t need = fuse_add_direntry_plus(req, (char *)dir_buf + used, size - used,
                                             l->names + d->name_at, &e, (off_t)d->off);
        if (need > size - used) break;
        used += need;
    }
    l->hint = i;
    if (newest_listing != l) { /* most recently used last */
        unlist_listing(l);
        list_listing_newest(l);
    }
    stats.readdirs++;
    fuse_reply_buf(req, (const char *)dir_buf, used);
    pthread_mutex_unlock(&lock);
    return 1;
}

/* ---- what cachefs calls ---- */

void cfr_configure(uint64_t new_chunk_size, uint64_t new_max_blocks,
                   uint64_t new_max_dentries) {
    pthread_mutex_lock(&lock);
    max_dentries = new_max_dentries;
    while (stats.dentries > max_dentries) remove_dentry(oldest_dentry);
    if (new_chunk_size != chunk_size) { /* the stored checksums would not match: start empty */
        while (all_files) remove_file(all_files);
        chunk_size = new_chunk_size;
    }
    max_blocks = new_max_blocks;
    while (stats.blocks > max_blocks && oldest) {
        stats.limit_drops++;
        remove_block(oldest);
    }
    pthread_mutex_unlock(&lock);
}

int cfr_register(uint64_t ino, uint64_t index, uint64_t block_size, uint64_t file_size,
                 uint64_t file_id, const char *path, uint64_t length,
                 const unsigned char *sums, size_t sums_len, uint64_t written_ino,
                 int64_t written_ctime_ns) {
    if (block_size == 0 || chunk_size == 0 || max_blocks == 0) return -1;
    uint64_t nblocks = (file_size + block_size - 1) / block_size;
    uint64_t start = index * block_size;
    uint64_t nchunks = (length + chunk_size - 1) / chunk_size;
    uint64_t expected = file_size - start < block_size ? file_size - start : block_size;
    if (nblocks > MAX_FILE_BLOCKS || index >= nblocks || length != expected ||
        sums_len != nchunks * 8) {
        pthread_mutex_lock(&lock);
        stats.refused++;
        pthread_mutex_unlock(&lock);
        return -1;
    }
    size_t path_len = strlen(path) + 1;
    uint64_t words = checked_words(nchunks);
    cfr_block *b = malloc(sizeof(*b) + (nchunks + words) * 8 + path_len);
    if (!b) return -1;
    b->index = index;
    b->backing_id = 0;
    b->backing_ino = 0;
    b->opened = NULL;
    b->bk_older = b->bk_newer = NULL;
    b->length = length;
    b->file_id = file_id;
    b->nchunks = nchunks;
    b->sums = (uint64_t *)(b + 1);
    for (uint64_t c = 0; c < nchunks; c++) b->sums[c] = be_get(sums + 8 * c, 8);
    b->checked = b->sums + nchunks;
    /* The state the admission wrote the file in (rule 2, note_checked()): every chunk holds the
     * bytes its checksum was computed from while the file stays in that state. */
    memset(b->checked, written_ino ? 0xff : 0, words * 8);
    b->checked_ino = written_ino;
    b->checked_ctime_ns = written_ctime_ns;
    b->path = (char *)(b->checked + words);
    memcpy(b->path, path, path_len);
    b->fd = -1;
    b->on_tmpfs = -1;
    b->fd_older = b->fd_newer = NULL;

    pthread_mutex_lock(&lock);
    cfr_file *f = find_file(ino);
    if (f && (f->block_size != block_size || f->file_size != file_size)) {
        remove_file(f); /* another version of the file: none of its blocks may stay */
        f = NULL;
    }
    if (!f) {
        /* Room for its block array: older blocks go first (their files' arrays with them). */
        while (array_slots + nblocks > ARRAY_SLOTS_PER_BLOCK * max_blocks && oldest) {
            stats.limit_drops++;
            remove_block(oldest);
        }
        if (array_slots + nblocks > ARRAY_SLOTS_PER_BLOCK * max_blocks ||
            grow(&by_ino, stats.files + 1, 1) != 0 ||
            !(f = calloc(1, sizeof(*f) + nblocks * sizeof(cfr_block *)))) {
            stats.refused++;
            pthread_mutex_unlock(&lock);
            free(b);
            return -1;
        }
        f->ino = ino;
        f->block_size = block_size;
        f->file_size = file_size;
        f->nblocks = nblocks;
        array_slots += nblocks;
        uint64_t s = slot_of(&by_ino, ino);
        f->next_by_ino = by_ino.slots[s];
        by_ino.slots[s] = f;
        f->next_all = all_files;
        if (all_files) all_files->prev_all = f;
        all_files = f;
        stats.files++;
    }
    if (grow(&by_id, stats.blocks + 1, 0) != 0) {
        stats.refused++;
        if (!f->held) unlink_file(f);
        pthread_mutex_unlock(&lock);
        free(b);
        return -1;
    }
    cfr_block *same = f->blocks[index];
    if (same && same->file_id == file_id && same->length == length) {
        /* Registered again (a LOOKUP, a READ in Python): the entry stays, with its open file
         * and backing file, and counts as the newest. */
        if (newest != same) {
            if (same->older) same->older->newer = same->newer;
            else oldest = same->newer;
            same->newer->older = same->older;
            same->newer = NULL;
            same->older = newest;
            newest->newer = same;
            newest = same;
        }
        pthread_mutex_unlock(&lock);
        free(b);
        return 0;
    }
    if (f->blocks[index]) {
        f->held++; /* keeps f alive while its old block goes */
        remove_block(f->blocks[index]);
        f->held--;
    }
    b->file = f;
    f->blocks[index] = b;
    f->held++;
    uint64_t s = slot_of(&by_id, file_id);
    b->next_by_id = by_id.slots[s];
    by_id.slots[s] = b;
    b->newer = NULL;
    b->older = newest;
    if (newest) newest->newer = b;
    else oldest = b;
    newest = b;
    stats.blocks++;
    stats.registered++;
    while (stats.blocks > max_blocks) {
        stats.limit_drops++;
        remove_block(oldest);
    }
    pthread_mutex_unlock(&lock);
    return 0;
}

void cfr_forget_file(uint64_t file_id) {
    pthread_mutex_lock(&lock);
    if (by_id.mask) {
        cfr_block *b = by_id.slots[slot_of(&by_id, file_id)];
        while (b) {
            cfr_block *next = b->next_by_id;
            if (b->file_id == file_id) remove_block(b);
            b = next;
        }
    }
    pthread_mutex_unlock(&lock);
}

void cfr_forget_inodes(uint64_t lo, uint64_t hi) {
    pthread_mutex_lock(&lock);
    cfr_dentry *d = oldest_dentry;
    while (d) {
        cfr_dentry *next = d->newer;
        if ((d->parent >= lo && d->parent <= hi) || (d->entry.ino >= lo && d->entry.ino <= hi))
            remove_dentry(d);
        d = next;
    }
    cfr_file *f = all_files;
    while (f) {
        cfr_file *next = f->next_all;
        if (f->ino >= lo && f->ino <= hi) remove_file(f);
        f = next;
    }
    cfr_listing *l = oldest_listing;
    while (l) {
        cfr_listing *next = l->newer;
        if (l->dir >= lo && l->dir <= hi) remove_listing(l);
        l = next;
    }
    forget_routes(lo, hi);
    pthread_mutex_unlock(&lock);
}

void cfr_clear(void) {
    cfr_forget_inodes(0, UINT64_MAX);
}

void cfr_get_stats(cfr_stats_t *out) {
    pthread_mutex_lock(&lock);
    stats.open_files = open_fds;
    stats.listing_bytes = listing_bytes;
    *out = stats;
    pthread_mutex_unlock(&lock);
}

void cfr_init_connection(struct fuse_conn_info *conn) {
    /* The kernel keeps at most max_background asynchronous requests (readahead READs) in
     * flight and calls the connection congested at congestion_threshold; libfuse's defaults
     * (12 and 9) are below the readers of one training job. Congested, the kernel drops the
     * readahead it just prepared (its pages allocated and freed again) and reads the file a
     * page at a time: measured here with 16 readers of 110 KB files, 1.2 READs per file where
     * one does. Queued READs cost the worker nothing until it reads them. */
    conn->max_background = CFR_MAX_BACKGROUND;
    conn->congestion_threshold = CFR_MAX_BACKGROUND * 3 / 4;
    /* Requests are read with one read(), not spliced into a pipe and read out of it: libfuse
     * splices them in because pyfuse3 has a write_buf handler, which pays only for large WRITEs
     * (a read-only mount has none) and costs every request a second syscall and a pipe page
     * (strace of one READ: splice of its 80 bytes into the pipe, then read of them). */
    conn->want &= ~FUSE_CAP_SPLICE_READ;
    /* READs of checked chunks are spliced (reply_spliced()); pyfuse3's own replies are
     * fuse_reply_buf(), which this does not change. */
    pthread_mutex_lock(&lock);
    splice_granted = (conn->capable & FUSE_CAP_SPLICE_WRITE) != 0;
    if (splice_granted) conn->want |= FUSE_CAP_SPLICE_WRITE;
    /* The largest READ the kernel sends is max_pages pages, which libfuse derives from
     * max_write after this callback. Lowered to what the splice pipes hold, a large file's
     * READs are spliced too, instead of read, checked and copied (one copy per byte instead
     * of two and a checksum pass: README, "The native READ path"). */
    uint64_t fit = largest_spliced_read();
    if (fit > 0 && fit < conn->max_write) conn->max_write = (unsigned)fit;
    stats.max_read = conn->max_write;
    connection_initialised = 1;
    pthread_mutex_unlock(&lock);
}

static int cache_listings;

void cfr_set_cache_listings(int on) {
    cache_listings = on;
}

void cfr_mark_listing(struct fuse_file_info *fi) {
    if (cache_listings) {
        fi->cache_readdir = 1;
        fi->keep_cache = 1;
    }
}

void cfr_count_batch(int requests) {
    pthread_mutex_lock(&lock);
    stats.batches++;
    stats.batched += (uint64_t)requests;
    pthread_mutex_unlock(&lock);
}

void cfr_count_unwaited(void) {
    pthread_mutex_lock(&lock);
    stats.unwaited++;
    pthread_mutex_unlock(&lock);
}

int cfr_fd_ready(int fd) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    struct timespec none = {.tv_sec = 0, .tv_nsec = 0};
    /* Any event: a request (POLLIN), or an error or hangup (the connection was aborted or
       unmounted), on which a read returns at once too (ENODEV: libfuse ends the session). */
    return ppoll(&p, 1, &none, NULL) == 1;
}

int cfr_fd_readable(int fd, int wait_us) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    struct timespec wait = {.tv_sec = 0, .tv_nsec = (long)wait_us * 1000};
    return ppoll(&p, 1, &wait, NULL) == 1 && (p.revents & POLLIN);
}

/* ---- which chunks of a block file passed their checksums ----
 *
 * A block remembers the chunks that passed their checksum while its file was in one state: the
 * file's inode number and ctime, with its size the block's length. Any write to the file moves
 * its ctime, and a file put in its place has another inode; so while fstat() shows that state,
 * those chunks hold the bytes that were checked, and a READ of them is spliced from the file
 * without reading it again (reply_spliced()). A new state forgets them all. A block can also
 * enter the table checked: cachefs passes the state its admission left the file in, right
 * after writing it from the bytes the checksums were computed from (cfr_register()), so the
 * first READ of a block a cold read just fetched is spliced too. The same record
 * says when a block's whole file may be handed to the kernel as a backing file (passthrough).
 * Between a check and the next fstat() the file is served as it is, as the kernel serves the
 * pages a READ put in the page cache: a block is checked when it enters the path (or enters
 * it in the state the cache wrote it in). */

static int64_t ctime_ns(const struct stat *st) {
    return (int64_t)st->st_ctim.tv_sec * 1000000000 + st->st_ctim.tv_nsec;
}

static int in_checked_state(const cfr_block *b, const struct stat *st) {
    return b->checked_ino == (uint64_t)st->st_ino && b->checked_ctime_ns == ctime_ns(st) &&
           (uint64_t)st->st_size == b->length;
}

/* The chunks of [at, at + len) of block `b` passed their checksums, read after fstat() gave
 * `st` (a write after that fstat() moves the ctime past `st`: the next READ sees a new state). */
static void note_checked(cfr_block *b, const struct stat *st, uint64_t at, uint64_t len) {
    if ((uint64_t)st->st_size != b->length) return;
    if (!in_checked_state(b, st)) {
        b->checked_ino = (uint64_t)st->st_ino;
        b->checked_ctime_ns = ctime_ns(st);
        memset(b->checked, 0, checked_words(b->nchunks) * 8);
    }
    if (len == 0) return;
    for (uint64_t c = at / chunk_size; c <= (at + len - 1) / chunk_size; c++)
        b->checked[c / 64] |= 1ull << (c % 64);
}

/* Whether every chunk of [lo, hi) of block `b` passed its checksum in the state `st` shows. */
static int span_checked(const cfr_block *b, const struct stat *st, uint64_t lo, uint64_t hi) {
    if (!in_checked_state(b, st)) return 0;
    for (uint64_t c = lo / chunk_size; lo < hi && c <= (hi - 1) / chunk_size; c++)
        if (!(b->checked[c / 64] >> (c % 64) & 1)) return 0;
    return 1;
}

/* ---- the READ ---- */

static int reserve(unsigned char **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    unsigned char *bigger = realloc(*buf, need);
    if (!bigger) return -1;
    *buf = bigger;
    *cap = need;
    return 0;
}

/* The block's file is gone or no longer the block's (short, long): drop the block. */
static void vanished(cfr_block *b) {
    stats.vanished++;
    remove_block(b);
}

/* After a failed open() or stat() of the block's file: a file removed behind the table's back
 * (ENOENT) drops the block; other errors leave it for the next READ. */
static void vanished_if_gone(cfr_block *b) {
    if (errno == ENOENT) vanished(b);
}

/* The block's file, open, with its fstat() in `st`; -1 when it cannot be had (the block is
 * dropped when its file is gone). */
static int open_block(cfr_block *b, struct stat *st) {
    int fd = block_fd(b);
    if (fd < 0) {
        vanished_if_gone(b);
        return -1;
    }
    if (b->on_tmpfs < 0) {
        struct statfs fs;
        if (fstatfs(fd, &fs) != 0) return -1;
        b->on_tmpfs = fs.f_type == TMPFS_MAGIC;
    }
    return fstat(fd, st) == 0 ? fd : -1;
}

/* Whether chunks of block `b` that passed their checksums in the file's current state may be
 * served again without reading them (rule 2): its file is on tmpfs (the RAM tier), where only
 * a write, which moves the ctime, changes its bytes; or passthrough was asked for, which hands
 * such files to the kernel anyway. A block file on a disk (the SSD tier) is read and checked by
 * every READ: a disk can lose bytes under an unchanged ctime. Known once the file was opened
 * (open_block()); until then, no. */
static int serves_checked(const cfr_block *b) {
    return passthrough_wanted || b->on_tmpfs == 1;
}

/* Whether block `b` may serve checked chunks, as far as is known before open_block(): not when
 * its file is known to be off tmpfs without passthrough (then no fstat() is needed at all). */
static int may_serve_checked(const cfr_block *b) {
    return passthrough_wanted || b->on_tmpfs != 0;
}

/* Read `len` bytes at `at` of the block's file into `dst` and check every chunk (the span is
 * chunk-aligned and holds whole chunks, except the block's last). 0 when good, and the chunks
 * are noted as checked in the state `st` (the file's fstat() before the read; NULL: not noted,
 * as a block that does not serve checked chunks never uses it, see serves_checked()); else the
 * block is dropped from the table (its file closed) and -1 returned. */
static int read_checked(cfr_block *b, const struct stat *st, unsigned char *dst, uint64_t at,
                        uint64_t len) {
    int fd = block_fd(b);
    if (fd < 0) {
        vanished_if_gone(b);
        return -1;
    }
    uint64_t done = 0;
    while (done < len) {
        ssize_t n = pread(fd, dst + done, len - done, (off_t)(at + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        done += (uint64_t)n;
    }
    if (done != len) {
        vanished(b);
        return -1;
    }
    for (uint64_t k = 0; k < len; k += chunk_size) {
        uint64_t n = len - k < chunk_size ? len - k : chunk_size;
        if (CFR_XXH3_64(dst + k, n) != b->sums[(at + k) / chunk_size]) {
            stats.corrupt++;
            remove_block(b);
            return -1;
        }
    }
    if (st) note_checked(b, st, at, len);
    return 0;
}

/* The part of block `i` of file `f` that [begin, end) covers: [*lo, *hi) within the block. */
static void block_span(const cfr_file *f, uint64_t i, uint64_t begin, uint64_t end,
                       uint64_t *lo, uint64_t *hi) {
    uint64_t start = i * f->block_size;
    uint64_t stop = start + f->blocks[i]->length;
    *lo = (begin > start ? begin : start) - start;
    *hi = (end < stop ? end : stop) - start;
}

/* ---- splicing checked chunks to /dev/fuse ----
 *
 * A READ whose every chunk passed its checksum in its file's current state, of block files
 * that may serve checked chunks (serves_checked(): on tmpfs, or any with passthrough asked
 * for), is answered without copying its bytes through the worker: splice() puts references to
 * the tier's pages into a pipe after the reply's header, and that pipe is spliced to /dev/fuse
 * (reply_spliced()), where the kernel copies the bytes once, into the reader's pages (a READ
 * read and checked here costs a pread() copy, an xxh3 pass and that copy: about a third more
 * worker CPU per small file, bench/results/native_read/2026-11-28-native-splice.md). The pipe
 * is empty after every reply (or replaced), so it never holds an evicted block's pages past
 * the READ. It needs the kernel to take spliced replies (FUSE_CAP_SPLICE_WRITE, asked for in
 * cfr_init_connection()) and a pipe with room for the READ and its header (and libfuse's pipe
 * too, where fuse_reply_data() sends the reply of a READ cfr_process_buf() is not processing:
 * none today, a fallback). A pipe may grow
 * past /proc/sys/fs/pipe-max-size (1 MiB by default) only with CAP_SYS_RESOURCE; without it,
 * READs up to that size less a few pages (a small file) are spliced and the kernel's 1 MiB
 * READs of a large file are read and checked, unless the administrator raises
 * fs.pipe-max-size (README, "The native READ path"). */

#define SPLICE_PIPE_BYTES (2u << 20) /* a 1 MiB READ (the most the kernel sends) fits twice */

static int splice_unavailable;       /* no pipe could be had: never ask again */
static int splice_pipe[2] = {-1, -1};
static uint64_t splice_pipe_bytes;   /* its capacity */

static void close_splice_pipe(void) {
    if (splice_pipe[0] < 0) return;
    close(splice_pipe[0]); /* the page references it still held go with it */
    close(splice_pipe[1]);
    splice_pipe[0] = splice_pipe[1] = -1;
}

/* /proc/sys/fs/pipe-max-size: the most a pipe may hold without CAP_SYS_RESOURCE. */
static int pipe_max_size(void) {
    char text[32] = {0};
    int fd = open("/proc/sys/fs/pipe-max-size", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    return n > 0 ? atoi(text) : -1;
}

/* The room a READ in `spans` pieces needs in the pipes beyond its bytes: a buffer per page or
 * piece of one, and the reply's header (libfuse sizes its pipe to the reply plus three pages,
 * fuse_send_data_iov()). */
static uint64_t splice_margin(uint64_t spans) {
    return (2 * spans + 3) * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* Whether `len` bytes in `spans` pieces can be spliced: the (empty) splice pipe, made on first
 * use, and libfuse's pipe have room for them and splice_margin(spans). */
static int splice_pipe_for(uint64_t len, uint64_t spans) {
    if (!splice_granted || splice_unavailable) return 0;
    if (splice_pipe[0] < 0) {
        if (pipe2(splice_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return 0;
        int size = fcntl(splice_pipe[0], F_SETPIPE_SZ, SPLICE_PIPE_BYTES);
        int limit = size < 0 && errno == EPERM ? pipe_max_size() : -1;
        if (limit > 0) size = fcntl(splice_pipe[0], F_SETPIPE_SZ, limit);
        if (size < 0) {
            close_splice_pipe();
            splice_unavailable = 1;
            return 0;
        }
        splice_pipe_bytes = (uint64_t)size;
    }
    return len + splice_margin(spans) <= splice_pipe_bytes;
}

/* The largest READ reply_spliced() can send whole, a multiple of the page size: the splice
 * pipe's room less the margin splice_pipe_for() keeps for a READ across two blocks (one
 * READ of at most 1 MiB spans two blocks at most; blocks are larger). 0 without splicing.
 * With CAP_SYS_RESOURCE the pipes hold 2 MiB and every READ fits; without it they hold
 * fs.pipe-max-size, 1 MiB by default, and a 1 MiB READ would not. */
static uint64_t largest_spliced_read(void) {
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    if (!splice_pipe_for(0, 2)) return 0; /* makes the pipe: its size is known after */
    uint64_t room = splice_pipe_bytes - splice_margin(2);
    return room - room % page;
}

/* Answer the READ of [begin, end) of file `f`, whose blocks' files were opened and whose every
 * chunk was checked, by splicing. 1 when answered; 0 when the pipe could not take it all
 * (nothing was sent: the caller reads and checks instead). */
static int reply_spliced(fuse_req_t req, cfr_file *f, uint64_t begin, uint64_t end) {
    uint64_t bs = f->block_size, first = begin / bs, last = (end - 1) / bs;
    if (!splice_pipe_for(end - begin, last - first + 1)) return 0;
    /* The READ cfr_process_buf() is processing (its inode and offset are this one's): the
     * reply is written here, its header and then the bytes into our pipe, and the pipe spliced
     * to the READ's descriptor in one call. libfuse's fuse_reply_data() would put the header
     * in a pipe of its own, splice our pipe into it and that one to the descriptor, and we
     * would then ask whether ours is empty: two syscalls more per READ for the same single
     * copy (strace of one READ). */
    struct cfr_out_header head = {(uint32_t)(sizeof head + (end - begin)), 0, current_read.unique};
    int own = current_read.unique != 0 && current_read.nodeid == f->ino &&
              current_read.offset == begin;
    if (own && write(splice_pipe[1], &head, sizeof head) != (ssize_t)sizeof head) {
        close_splice_pipe(); /* (an empty pipe of this size takes 16 bytes: never here) */
        return 0;
    }
    for (uint64_t i = first; i <= last; i++) {
        cfr_block *b = f->blocks[i];
        uint64_t lo, hi;
        block_span(f, i, begin, end, &lo, &hi);
        loff_t at = (loff_t)lo;
        while ((uint64_t)at < hi) {
            ssize_t n = b->fd < 0 ? -1 /* closed by the fd bound since it was opened */
                                  : splice(b->fd, &at, splice_pipe[1], NULL, hi - (uint64_t)at,
                                           SPLICE_F_NONBLOCK);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) { /* short (the file shrank) or failed: read and check instead */
                close_splice_pipe();
                return 0;
            }
        }
    }
    if (own) {
        /* Not taken whole (the connection was aborted: ENOENT; or a copy failed after the
         * kernel found the READ, which it then ended with EIO), the pipe's contents are dropped
         * and the caller replies the ordinary way, which the kernel refuses as it did this one
         * or takes: never a second answer to a READ, since ids are not reused. */
        ssize_t sent = splice(splice_pipe[0], NULL, current_read.fd, NULL, head.len, 0);
        if (sent != (ssize_t)head.len) {
            close_splice_pipe();
            return 0;
        }
        fuse_reply_none(req); /* answered: libfuse only frees the request */
        return 1;
    }
    struct fuse_bufvec bufv = FUSE_BUFVEC_INIT(end - begin);
    bufv.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_RETRY;
    bufv.buf[0].fd = splice_pipe[0];
    /* Its error (the request was interrupted) needs nothing from us, as for fuse_reply_buf. */
    fuse_reply_data(req, &bufv, 0);
    int left = 0;
    if (ioctl(splice_pipe[0], FIONREAD, &left) != 0 || left != 0) close_splice_pipe();
    return 1;
}

int cfr_try_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off) {
    if (off < 0) return 0;
    pthread_mutex_lock(&lock);
    cfr_file *f = find_file(ino);
    if (!f) goto fall_through_quietly;
    uint64_t begin = (uint64_t)off;
    uint64_t end = begin + size < f->file_size ? begin + size : f->file_size;
    uint64_t pos = 0;
    int spliced = 0;
    if (begin < end) {
        uint64_t bs = f->block_size, first = begin / bs, last = (end - 1) / bs;
        int all_checked = 1;
        for (uint64_t i = first; i <= last; i++) {
            cfr_block *b = f->blocks[i];
            if (!b) goto fall_through;
            if (all_checked && !may_serve_checked(b)) {
                all_checked = 0; /* read and checked: no fstat() needed */
            } else if (all_checked) {
                struct stat st;
                uint64_t lo, hi;
                block_span(f, i, begin, end, &lo, &hi);
                if (open_block(b, &st) < 0) goto fall_through;
                all_checked = serves_checked(b) && span_checked(b, &st, lo, hi);
            }
        }
        if (all_checked && reply_spliced(req, f, begin, end)) {
            pos = end - begin;
            spliced = 1;
            goto answered;
        }
        if (reserve(&out_buf, &out_cap, end - begin) != 0) goto fall_through;
        for (uint64_t i = first; i <= last; i++) {
            cfr_block *b = f->blocks[i];
            struct stat st;
            uint64_t lo, hi;
            block_span(f, i, begin, end, &lo, &hi);
            uint64_t span_lo = lo - lo % chunk_size;
            uint64_t span_hi = hi + (chunk_size - hi % chunk_size) % chunk_size;
            if (span_hi > b->length) span_hi = b->length;
            /* The file's state, for splicing these chunks next time (see serves_checked()). */
            const struct stat *state = NULL;
            if (may_serve_checked(b)) {
                if (open_block(b, &st) < 0) goto fall_through;
                if (serves_checked(b)) state = &st;
            }
            if (span_lo == lo && span_hi == hi) { /* aligned: read straight into the reply */
                if (read_checked(b, state, out_buf + pos, lo, hi - lo) != 0) goto fall_through;
            } else {
                if (reserve(&scratch_buf, &scratch_cap, span_hi - span_lo) != 0 ||
                    read_checked(b, state, scratch_buf, span_lo, span_hi - span_lo) != 0)
                    goto fall_through;
                memcpy(out_buf + pos, scratch_buf + (lo - span_lo), hi - lo);
            }
            pos += hi - lo;
        }
    }
answered:
    stats.reads++;
    stats.first_reads += off == 0;
    stats.spliced += (uint64_t)spliced;
    stats.bytes += pos;
    /* Replied under the lock: out_buf and the splice pipe are shared, and no forget may close
     * a block file between its check and the reply. The reply's error (the request was
     * interrupted) needs nothing from us: the request is answered either way. */
    if (!spliced) fuse_reply_buf(req, (const char *)out_buf, pos);
    pthread_mutex_unlock(&lock);
    return 1;

fall_through:
    stats.fallbacks++;
fall_through_quietly:
    pthread_mutex_unlock(&lock);
    return 0;
}

/* ---- peer answers: block requests of other workers answered from the table ----
 *
 * Another worker asks this one for a block over the block protocol (cachefs/peer/wire.py): a
 * request frame names the file by dataset, etag, key, size and block size, and the block by its
 * index. cachefs's peer server (cachefs/peer/server.py) hands the frames it has received to
 * cfr_peer_answer(), which answers every one in a row whose block is in this table, on tmpfs and
 * checked, as the server's Python path would: the answer's head and chunk checksums, then the
 * block sent from its file with sendfile() (the reader checks the bytes against those
 * checksums again). It stops at the first frame it cannot answer so, which the server then
 * handles as before (a block elsewhere, not cached, a malformed frame, a refusal).
 *
 * Which file a request names: cachefs registers, with a file's blocks, the bytes a request for
 * that version of it carries (cfr_register_peer_name(): the head's dataset, etag and key
 * lengths, file size and block size as on the wire, then the three names; the server
 * checks the same fields against the snapshot it serves, FileSystem._peer_file). A request
 * matches only if all those bytes are equal (hashed to find them, compared to match). The name
 * goes with the file's entry: every forget that drops the file's blocks (rule 3) drops it too,
 * so a refreshed file or a removed dataset is never answered from here; the blocks follow the
 * same rules as a READ's (rule 2: every chunk checked, or checked before in the file's current
 * state, which only tmpfs files may count on, so only tmpfs blocks are answered here).
 * The mutex is held from the lookup to the end of the send, as for a READ. The socket is
 * non-blocking: an answer the socket cannot take whole is handed back to the server (a
 * duplicate of the block file's descriptor, the head and how much was sent), which finishes it
 * when the socket drains; a frame the socket has no room for at all is not taken. */

#define PEER_REQUEST_HEAD 34      /* wire.REQUEST: "!IBxHHIQQI" */
#define PEER_ANSWER_HEAD 24       /* wire.ANSWER: "!IB3xIIQ" */
#define PEER_FIXED 20             /* the head's bytes 6..22 and 30..34 (see above) */
#define PEER_FLAG_CACHED_ONLY 1
#define PEER_MAX_NAME 0xFFFFu     /* wire.MAX_NAME_LEN */

static table_t by_peer;
static unsigned char *answer_buf;
static size_t answer_cap;

static uint64_t peer_name_hash(const unsigned char *fixed, const unsigned char *names,
                               size_t names_len) {
    return XXH3_64bits_withSeed(names, names_len, XXH3_64bits(fixed, PEER_FIXED));
}

static void unlink_peer_name(cfr_file *f) {
    if (!f->peer_name) return;
    cfr_file **p = (cfr_file **)&by_peer.slots[slot_of(&by_peer, f->peer_hash)];
    while (*p != f) p = &(*p)->next_by_peer;
    *p = f->next_by_peer;
    free(f->peer_name);
    f->peer_name = NULL;
    f->peer_name_len = 0;
    stats.peer_names--;
}

static int grow_peer_names(void) {
    if (by_peer.mask && stats.peer_names + 1 <= by_peer.mask + 1) return 0;
    uint64_t size = by_peer.mask ? (by_peer.mask + 1) * 2 : 1024;
    void **slots = calloc(size, sizeof(void *));
    if (!slots) return -1;
    table_t bigger = {slots, size - 1};
    for (cfr_file *f = all_files; f; f = f->next_all) {
        if (!f->peer_name) continue;
        uint64_t s = slot_of(&bigger, f->peer_hash);
        f->next_by_peer = slots[s];
        slots[s] = f;
    }
    free(by_peer.slots);
    by_peer = bigger;
    return 0;
}

int cfr_register_peer_name(uint64_t ino, const unsigned char *name, size_t len) {
    if (len < PEER_FIXED) return -1;
    pthread_mutex_lock(&lock);
    cfr_file *f = find_file(ino);
    if (f && f->peer_name && f->peer_name_len == len && memcmp(f->peer_name, name, len) == 0) {
        pthread_mutex_unlock(&lock);
        return 0; /* registered with the file's blocks before */
    }
    unsigned char *copy = f ? malloc(len) : NULL;
    if (!copy || grow_peer_names() != 0) {
        pthread_mutex_unlock(&lock);
        free(copy);
        return -1;
    }
    unlink_peer_name(f);
    memcpy(copy, name, len);
    f->peer_name = copy;
    f->peer_name_len = len;
    f->peer_hash = peer_name_hash(copy, copy + PEER_FIXED, len - PEER_FIXED);
    uint64_t s = slot_of(&by_peer, f->peer_hash);
    f->next_by_peer = by_peer.slots[s];
    by_peer.slots[s] = f;
    stats.peer_names++;
    pthread_mutex_unlock(&lock);
    return 0;
}

static cfr_file *find_peer_name(const unsigned char *fixed, const unsigned char *names,
                                size_t names_len) {
    if (!by_peer.mask) return NULL;
    uint64_t hash = peer_name_hash(fixed, names, names_len);
    for (cfr_file *f = by_peer.slots[slot_of(&by_peer, hash)]; f; f = f->next_by_peer)
        if (f->peer_hash == hash && f->peer_name_len == PEER_FIXED + names_len &&
            memcmp(f->peer_name, fixed, PEER_FIXED) == 0 &&
            memcmp(f->peer_name + PEER_FIXED, names, names_len) == 0)
            return f;
    return NULL;
}

/* Send `len` bytes of `buf` to the non-blocking socket: the bytes sent (fewer when it is
 * full), or -1 with errno set when the connection broke. */
static ssize_t send_some(int sock, const unsigned char *buf, size_t len, int more) {
    size_t done = 0;
    while (done < len) {
        ssize_t n = send(sock, buf + done, len - done,
                         MSG_DONTWAIT | MSG_NOSIGNAL | (more ? MSG_MORE : 0));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (n < 0) return -1;
        done += (size_t)n;
    }
    return (ssize_t)done;
}

int cfr_peer_answer(int sock, const unsigned char *frames, size_t len, size_t max_answers,
                    cfr_peer_result *out) {
    uint64_t *plain_inos = out->plain_inos; /* the caller's room */
    memset(out, 0, sizeof(*out));
    out->plain_inos = plain_inos;
    out->partial_fd = -1;
    size_t pos = 0;
    pthread_mutex_lock(&lock);
    while (out->answered < max_answers && len - pos >= PEER_REQUEST_HEAD) {
        const unsigned char *h = frames + pos;
        uint64_t flags = h[4];
        uint64_t names_len = be_get(h + 6, 2) + be_get(h + 8, 2) + be_get(h + 10, 4);
        uint64_t index = be_get(h + 22, 8);
        if ((flags & ~(uint64_t)PEER_FLAG_CACHED_ONLY) || be_get(h + 10, 4) > PEER_MAX_NAME ||
            len - pos - PEER_REQUEST_HEAD < names_len)
            break; /* the server refuses it, or has not all of it yet */
        unsigned char fixed[PEER_FIXED];
        memcpy(fixed, h + 6, 16);
        memcpy(fixed + 16, h + 30, 4);
        cfr_file *f = find_peer_name(fixed, h + PEER_REQUEST_HEAD, names_len);
        cfr_block *b = f && index < f->nblocks ? f->blocks[index] : NULL;
        struct stat st;
        if (!b || open_block(b, &st) < 0 || b->on_tmpfs != 1) break;
        uint64_t length = b->length;
        if (!span_checked(b, &st, 0, length)) {
            if (reserve(&scratch_buf, &scratch_cap, length) != 0 ||
                read_checked(b, &st, scratch_buf, 0, length) != 0)
                break; /* dropped (gone, short, corrupt): the server's own path handles it */
            stats.peer_checked++;
        }
        size_t head_len = PEER_ANSWER_HEAD + b->nchunks * 8;
        if (reserve(&answer_buf, &answer_cap, head_len) != 0) break;
        memcpy(answer_buf, h, 4); /* the request id */
        memset(answer_buf + 4, 0, 4); /* status OK, padding */
        be_put(answer_buf + 8, chunk_size, 4);
        be_put(answer_buf + 12, b->nchunks * 8, 4);
        be_put(answer_buf + 16, length, 8);
        for (uint64_t c = 0; c < b->nchunks; c++)
            be_put(answer_buf + PEER_ANSWER_HEAD + c * 8, b->sums[c], 8);
        ssize_t sent = send_some(sock, answer_buf, head_len, 1);
        if (sent < 0) {
            out->error = errno;
            break;
        }
        if (sent == 0) break; /* the socket is full: the server answers it when it drains */
        off_t at = 0;
        while ((size_t)sent == head_len && (uint64_t)at < length) {
            ssize_t n = sendfile(sock, b->fd, &at, length - (uint64_t)at);
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
            if (n <= 0) { /* the connection broke, or the file shrank after its check */
                out->error = n < 0 ? errno : EIO;
                break;
            }
        }
        if (out->error) break; /* the head went out: the connection must close */
        pos += PEER_REQUEST_HEAD + names_len;
        out->answered++;
        if (!(flags & PEER_FLAG_CACHED_ONLY)) out->plain_inos[out->plain++] = f->ino;
        stats.peer_answers++;
        stats.peer_bytes += length;
        if ((size_t)sent < head_len || (uint64_t)at < length) { /* the rest when it drains */
            out->partial_fd = fcntl(b->fd, F_DUPFD_CLOEXEC, 0);
            if (out->partial_fd < 0) out->error = errno;
            out->partial_head = answer_buf;
            out->partial_head_len = head_len;
            out->partial_sent = (uint64_t)sent + (uint64_t)at;
            out->partial_length = length;
            break;
        }
    }
    out->consumed = pos;
    pthread_mutex_unlock(&lock);
    return out->error ? -1 : 0;
}

/* ---- passthrough: OPEN hands a cached file's block file to the kernel ----
 *
 * With FUSE passthrough (Linux >= 6.9) an OPEN reply may name a "backing file" the server
 * registered with the kernel (FUSE_DEV_IOC_BACKING_OPEN); the kernel then reads that file
 * itself for this open file, and no READ of it reaches user space. A small file whose one block
 * is in the RAM tier is such a file: its block file holds exactly its bytes. A first read then
 * costs an OPEN and a RELEASE answered here (no data copied through the worker), and the reader
 * copies straight from the tier's tmpfs pages, as from any tmpfs file.
 *
 * Negotiation. libfuse 3.14 does not know FUSE_PASSTHROUGH. cfr_process_buf() lets libfuse
 * process FUSE_INIT as always, with the session fd pointed at a pipe for that one call (dup3),
 * so that libfuse's reply lands there; it then adds FUSE_INIT_EXT, FUSE_PASSTHROUGH and
 * max_stack_depth 1 to that reply and writes it to /dev/fuse. libfuse's own state is what its
 * reply says, so nothing else changes. A kernel that does not offer passthrough gets libfuse's
 * reply unchanged, and cachefs goes on in no-open mode (OPEN answered ENOSYS in Python).
 *
 * The kernel's rules for one inode (fs/fuse/iomode.c): while an open file of an inode reads
 * through a backing file, every new open of it must name the same backing file, and an inode
 * with open files that read through the page cache cannot get a backing file (either mistake
 * fails the open with EIO). So OPEN and RELEASE of every file are answered here, and `opened`
 * records, per inode, the OPENs whose RELEASE has not come yet and which backing file (if any)
 * they were given; a new OPEN follows the record:
 *   - none outstanding: a file whose one block is in the table gets that block's backing
 *     file (see block_backing(): made after every chunk of the block file passed its checksum,
 *     or with the file in the state the cache wrote it in (rule 2), then kept with the block for the next opens while the file's ctime and size stay put);
 *     any other file, or one failing its checksums, an ordinary open (FOPEN_KEEP_CACHE: pages
 *     stay across opens, as in no-open mode);
 *   - backing file outstanding: the same backing file; if the inode's block has left the table
 *     since (evicted, or the file refreshed), FOPEN_DIRECT_IO as well, so that reads go to the
 *     worker as READ requests and get the bytes the snapshot serves now;
 *   - ordinary opens outstanding: an ordinary open.
 * File handles are 0 (the patched read() then gets the inode, as in no-open mode). A RELEASE
 * ends one OPEN. An OPEN whose reply the kernel refuses (the opener was killed) gets no
 * RELEASE, so it is undone at once.
 *
 * Coherence with the cache (the rules at the top of this file): a forget removes the block
 * from the table and closes its backing file's kernel id, so no later OPEN hands it out; files
 * already open on it keep reading it until they are closed (their record closes the id with
 * the last RELEASE), like a reader holding any tmpfs file open: the space of an evicted block
 * goes when the last such file is closed. */

#define CFR_OP_INIT 26
#define CFR_OP_READ 15
#define CFR_INIT_EXT (1u << 30)
#define CFR_INIT2_PASSTHROUGH (1u << 5) /* FUSE_PASSTHROUGH, bit 37 of the 64 INIT flags */
#define CFR_FOPEN_DIRECT_IO (1u << 0)
#define CFR_FOPEN_KEEP_CACHE (1u << 1)
#define CFR_FOPEN_NOFLUSH (1u << 5)
#define CFR_FOPEN_PASSTHROUGH (1u << 7)
/* fuse_init_out (64 bytes since protocol 7.23), after the 16-byte fuse_out_header. */
#define INIT_OUT_SIZE 64
#define INIT_OUT_FLAGS 12
#define INIT_OUT_FLAGS2 32
#define INIT_OUT_MAX_STACK_DEPTH 36
#define OPENED_SLOTS 4096
/* Most blocks that keep a backing file between opens (each holds an open file in the kernel,
 * ~0.3 KB, and none of the process's descriptors); the least recently opened goes first. */
#define MAX_BACKING_FILES 65536

struct cfr_open_out {
    uint64_t fh;
    uint32_t open_flags;
    int32_t backing_id;
};
struct cfr_backing_map {
    int32_t fd;
    uint32_t flags;
    uint64_t padding;
};
#define CFR_DEV_IOC_BACKING_OPEN _IOW(229, 1, struct cfr_backing_map)
#define CFR_DEV_IOC_BACKING_CLOSE _IOW(229, 2, uint32_t)

typedef struct cfr_opened {
    uint64_t ino;
    uint64_t count;     /* OPENs answered whose RELEASE has not come */
    int32_t backing_id; /* > 0: they read through this backing file ... */
    cfr_block *block;   /* ... which is this block's (NULL: the block left the table, and
                           the id is this record's to close) */
    struct cfr_opened *next;
} cfr_opened;

static int dev_fd = -1;
static int backing_denied; /* the kernel said EPERM (no CAP_SYS_ADMIN): stop asking */
static cfr_opened *opened[OPENED_SLOTS];
static cfr_block *oldest_backing, *newest_backing;

void cfr_want_passthrough(int on) {
    pthread_mutex_lock(&lock);
    passthrough_wanted = on;
    pthread_mutex_unlock(&lock);
}

static void put_u32(unsigned char *p, uint32_t v) {
    memcpy(p, &v, 4);
}
static uint32_t get_u32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static void unlist_backing(cfr_block *b);

/* A new connection: nothing of the last one's backing files or open files is valid (its
 * ids died with its /dev/fuse). */
static void forget_connection(void) {
    for (cfr_block *b = newest_backing; b; b = newest_backing) {
        unlist_backing(b);
        b->backing_id = 0;
        b->opened = NULL;
    }
    for (size_t i = 0; i < OPENED_SLOTS; i++)
        while (opened[i]) {
            cfr_opened *o = opened[i];
            opened[i] = o->next;
            free(o);
        }
    stats.passthrough = stats.backing_files = stats.kept_backings = stats.opened = 0;
    dev_fd = -1;
    backing_denied = 0;
}

#define CFR_INIT_WRITEBACK_CACHE (1u << 16) /* the kernel refuses passthrough with it */

/* libfuse answers INIT into a pipe; its reply, with passthrough added, goes to the kernel. */
static void init_with_passthrough(struct fuse_session *se, const struct fuse_buf *buf, int fd) {
    int pipe_fds[2];
    if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) {
        fuse_session_process_buf(se, buf);
        return;
    }
    int saved = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (saved < 0 || dup3(pipe_fds[1], fd, O_CLOEXEC) < 0) {
        if (saved >= 0) close(saved);
        close(pipe_fds[0]);
        close(pipe_fds[1]);
        fuse_session_process_buf(se, buf);
        return;
    }
    fuse_session_process_buf(se, buf);
    /* The session fd is /dev/fuse again (dup3 onto a valid fd number cannot fail but for
     * EINTR, which it does not return on Linux). */
    dup3(saved, fd, O_CLOEXEC);
    close(saved);
    close(pipe_fds[1]);
    unsigned char reply[sizeof(struct cfr_out_header) + INIT_OUT_SIZE + 64];
    unsigned char original[sizeof reply];
    ssize_t n = read(pipe_fds[0], reply, sizeof reply);
    close(pipe_fds[0]);
    if (n <= 0) return; /* libfuse's own write failed: it would have answered nothing */
    memcpy(original, reply, (size_t)n);
    struct cfr_out_header out;
    memcpy(&out, reply, sizeof out);
    int granted = 0;
    unsigned char *arg = reply + sizeof out;
    if ((size_t)n >= sizeof out + INIT_OUT_SIZE && out.len == (uint32_t)n && out.error == 0 &&
        !(get_u32(arg + INIT_OUT_FLAGS) & CFR_INIT_WRITEBACK_CACHE)) {
        put_u32(arg + INIT_OUT_FLAGS, get_u32(arg + INIT_OUT_FLAGS) | CFR_INIT_EXT);
        put_u32(arg + INIT_OUT_FLAGS2, get_u32(arg + INIT_OUT_FLAGS2) | CFR_INIT2_PASSTHROUGH);
        put_u32(arg + INIT_OUT_MAX_STACK_DEPTH, 1); /* backing files on tmpfs, ext4, ...: 0 */
        granted = 1;
    }
    ssize_t written = write(fd, reply, (size_t)n);
    if (written != n && granted) { /* refused with passthrough: libfuse's reply as it was */
        granted = 0;
        written = write(fd, original, (size_t)n);
    }
    if (written == n && granted) {
        pthread_mutex_lock(&lock);
        dev_fd = fd;
        stats.passthrough = 1;
        pthread_mutex_unlock(&lock);
    }
}

/* ---- clones: more serving processes on one connection ----------------------------------
 *
 * cachefs's serving processes (cachefs/fs/serving.py) each read a clone of the mount's
 * /dev/fuse descriptor (FUSE_DEV_IOC_CLONE): the kernel hands every request to whichever
 * descriptor of the connection reads it first, and takes its reply only on that descriptor.
 * libfuse answers nothing but FUSE_INIT until it has processed one, and the kernel sends INIT
 * once, to the first descriptor. So the mount's session keeps the INIT request it processed
 * (keep_init_request()), and a clone's session processes a copy of it before it reads
 * anything (cfr_replay_init()): libfuse and this file then hold the state the mount's INIT
 * gave (the same flags and limits: the request is the same and so is the code answering it).
 * The reply goes to the clone, where the kernel finds no request of that id and refuses it
 * with ENOENT, which libfuse ignores ("interrupted"); the kernel's state is the mount's. */

/* The smallest FUSE_INIT: the header and a fuse_init_in before protocol 7.36 (major, minor,
 * max_readahead, flags); kernels from 7.36 on send more (flags2 and what follows). */
#define CFR_INIT_MIN (sizeof(struct cfr_in_header) + 16)

static _Alignas(8) unsigned char init_request[CFR_INIT_REQUEST_MAX];
static size_t init_request_len;

static void keep_init_request(const unsigned char *mem, size_t len) {
    if (len > sizeof init_request) len = 0; /* a kernel with a longer INIT: clones refused */
    pthread_mutex_lock(&lock);
    memcpy(init_request, mem, len);
    init_request_len = len;
    pthread_mutex_unlock(&lock);
}

size_t cfr_init_request(unsigned char *out, size_t cap) {
    pthread_mutex_lock(&lock);
    size_t len = init_request_len <= cap ? init_request_len : 0;
    memcpy(out, init_request, len);
    pthread_mutex_unlock(&lock);
    return len;
}

int cfr_replay_init(struct fuse_session *se, const unsigned char *request, size_t len) {
    struct cfr_in_header in;
    _Alignas(8) unsigned char copy[CFR_INIT_REQUEST_MAX]; /* libfuse reads it as its structs */
    if (len < CFR_INIT_MIN || len > sizeof copy) return -1;
    memcpy(&in, request, sizeof in);
    if (in.opcode != CFR_OP_INIT || in.len != len) return -1;
    memcpy(copy, request, len); /* libfuse reads the request in place */
    struct fuse_buf buf;
    memset(&buf, 0, sizeof buf);
    buf.mem = copy;
    buf.size = len;
    buf.fd = -1;
    fuse_session_process_buf(se, &buf);
    return connection_initialised ? 0 : -1;
}

static void process_buf(struct fuse_session *se, const struct fuse_buf *buf, int fd);

void cfr_process_buf(struct fuse_session *se, const struct fuse_buf *buf, int fd) {
    struct cfr_in_header in;
    uint64_t read_in[2]; /* fuse_read_in's fh and offset */
    if (!(buf->flags & FUSE_BUF_IS_FD) && buf->size >= sizeof in + sizeof read_in && fd >= 0) {
        memcpy(&in, buf->mem, sizeof in);
        memcpy(read_in, (const unsigned char *)buf->mem + sizeof in, sizeof read_in);
        if (in.opcode == CFR_OP_READ) {
            current_read.unique = in.unique;
            current_read.nodeid = in.nodeid;
            current_read.offset = read_in[1];
            current_read.fd = fd;
        }
    }
    process_buf(se, buf, fd);
    current_read.unique = 0;
}

static void process_buf(struct fuse_session *se, const struct fuse_buf *buf, int fd) {
    const unsigned char *mem = buf->mem;
    struct cfr_in_header in;
    struct cfr_init_in init;
    if (!(buf->flags & FUSE_BUF_IS_FD) && buf->size >= CFR_INIT_MIN) {
        memcpy(&in, mem, sizeof in);
        if (in.opcode == CFR_OP_INIT) keep_init_request(mem, buf->size); /* for clones */
    }
    if ((buf->flags & FUSE_BUF_IS_FD) || buf->size < sizeof in + sizeof init) {
        fuse_session_process_buf(se, buf);
        return;
    }
    memcpy(&in, mem, sizeof in);
    memcpy(&init, mem + sizeof in, sizeof init);
    if (!passthrough_wanted) {
        fuse_session_process_buf(se, buf);
        return;
    }
    if (in.opcode == CFR_OP_INIT) {
        pthread_mutex_lock(&lock);
        forget_connection();
        pthread_mutex_unlock(&lock);
    }
    if (in.opcode != CFR_OP_INIT || !(init.flags & CFR_INIT_EXT) ||
        !(init.flags2 & CFR_INIT2_PASSTHROUGH)) {
        fuse_session_process_buf(se, buf); /* not INIT, or a kernel without passthrough */
        return;
    }
    init_with_passthrough(se, buf, fd);
}

static cfr_opened **opened_slot(uint64_t ino) {
    cfr_opened **p = &opened[(ino * 0x9E3779B97F4A7C15ull) >> 52];
    while (*p && (*p)->ino != ino) p = &(*p)->next;
    return p;
}

/* The block of `ino` when it is the file's only one and the table holds it, else NULL. */
static cfr_block *whole_file_block(fuse_ino_t ino) {
    cfr_file *f = find_file(ino);
    if (!f || f->nblocks != 1 || !f->blocks[0]) return NULL;
    cfr_block *b = f->blocks[0];
    return b->length == f->file_size ? b : NULL;
}

static void close_backing(int32_t id) {
    uint32_t kernel_id = (uint32_t)id;
    ioctl(dev_fd, CFR_DEV_IOC_BACKING_CLOSE, &kernel_id);
    stats.backing_files--;
}

static void unlist_backing(cfr_block *b) {
    if (b->bk_older) b->bk_older->bk_newer = b->bk_newer;
    else oldest_backing = b->bk_newer;
    if (b->bk_newer) b->bk_newer->bk_older = b->bk_older;
    else newest_backing = b->bk_older;
    b->bk_older = b->bk_newer = NULL;
}

static void list_backing_newest(cfr_block *b) {
    b->bk_newer = NULL;
    b->bk_older = newest_backing;
    if (newest_backing) newest_backing->bk_newer = b;
    else oldest_backing = b;
    newest_backing = b;
}

/* Block `b` gives up its backing file (it leaves the table, or the bound or a changed file
 * needs it): the kernel id is closed, or, while open files read through it, handed to their
 * record, which closes it with the last RELEASE. */
static void drop_backing(cfr_block *b) {
    if (b->backing_id <= 0) return;
    unlist_backing(b);
    stats.kept_backings--;
    if (b->opened) b->opened->block = NULL;
    else close_backing(b->backing_id);
    b->backing_id = 0;
    b->opened = NULL;
}

/* stat() of block `b`'s file (its open descriptor if it has one); -1 if that fails, and the
 * block is dropped from the table when the file is gone. */
static int stat_block(cfr_block *b, struct stat *st) {
    if ((b->fd >= 0 ? fstat(b->fd, st) : stat(b->path, st)) == 0) return 0;
    vanished_if_gone(b);
    return -1;
}

/* Whether `st` is the state of block `b`'s file in which every chunk of it was checked (a write
 * to it since moves its ctime). */
static int unchanged_since_check(const cfr_block *b, const struct stat *st) {
    return span_checked(b, st, 0, b->length);
}

/* Check every chunk of block `b`'s file, whose stat() before the read is `st`, and note them
 * checked; -1 (the block dropped from the table when it is short, long or corrupt) if it fails. */
static int check_block(cfr_block *b, const struct stat *st) {
    if ((uint64_t)st->st_size != b->length) { /* a passthrough read would go by this size */
        vanished(b);
        return -1;
    }
    if (reserve(&scratch_buf, &scratch_cap, b->length) != 0 ||
        read_checked(b, st, scratch_buf, 0, b->length) != 0)
        return -1;
    return 0;
}

/* Block `b`'s backing-file id: made after checking every chunk of its file (or with the file in
 * the state the cache wrote it in, see cfr_register()), then kept for the
 * next opens (at most MAX_BACKING_FILES blocks keep one) as long as the file is unchanged since
 * (unchanged_since_check); a write to it moves its ctime, and the next open checks it again.
 * 0 if the block fails its checks (it is then dropped), cannot be read, or the kernel refuses.
 * Between two checks the kernel reads the file as it is, as it serves the pages a READ put in
 * the page cache: a block is checked when it enters the path (or enters it in the state the
 * cache wrote it in). */
static int32_t block_backing(cfr_block *b) {
    struct stat st;
    if (b->backing_id > 0) {
        if (stat_block(b, &st) != 0) return 0;
        if ((uint64_t)st.st_ino == b->backing_ino && unchanged_since_check(b, &st)) {
            if (newest_backing != b) {
                unlist_backing(b);
                list_backing_newest(b);
            }
            return b->backing_id;
        }
        drop_backing(b);
    }
    if (backing_denied) return 0;
    int fd = block_fd(b); /* the descriptor registered is the one whose file is checked */
    if (fd < 0 || fstat(fd, &st) != 0) {
        if (fd < 0) vanished_if_gone(b);
        return 0;
    }
    if (!unchanged_since_check(b, &st) && check_block(b, &st) != 0) return 0;
    struct cfr_backing_map map = {.fd = fd, .flags = 0, .padding = 0};
    int id = ioctl(dev_fd, CFR_DEV_IOC_BACKING_OPEN, &map);
    if (id <= 0) {
        stats.pt_refused++;
        if (errno == EPERM) backing_denied = 1; /* not CAP_SYS_ADMIN: never will */
        return 0;
    }
    stats.backing_files++;
    while (stats.kept_backings >= MAX_BACKING_FILES && oldest_backing) drop_backing(oldest_backing);
    b->backing_id = id;
    b->backing_ino = (uint64_t)st.st_ino;
    list_backing_newest(b);
    stats.kept_backings++;
    return id;
}

/* With files of an inode open on block `b`'s backing file: whether a new open may read it too.
 * Not if the block file changed since it was checked and fails its checks now (the block is
 * then dropped, and its backing file handed to the open files' record) or is another file. */
static int backing_still_good(cfr_block *b) {
    struct stat st;
    if (stat_block(b, &st) != 0) return 0;
    if ((uint64_t)st.st_ino != b->backing_ino) return 0; /* not the file the kernel reads */
    return unchanged_since_check(b, &st) || check_block(b, &st) == 0;
}

static void release_one(cfr_opened **slot) {
    cfr_opened *o = *slot;
    if (--o->count) return;
    if (o->block) o->block->opened = NULL;
    else if (o->backing_id > 0) close_backing(o->backing_id);
    *slot = o->next;
    free(o);
    stats.opened--;
}

int cfr_try_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if (!stats.passthrough) return 0; /* read without the lock: set once, at INIT */
    if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & (O_TRUNC | O_APPEND | O_CREAT))) {
        fuse_reply_err(req, EROFS); /* the mount is read-only (the kernel says so first) */
        return 1;
    }
    pthread_mutex_lock(&lock);
    cfr_opened **slot = opened_slot(ino);
    if (!*slot) {
        cfr_opened *o = calloc(1, sizeof *o);
        if (!o) {
            pthread_mutex_unlock(&lock);
            fuse_reply_err(req, ENOMEM);
            return 1;
        }
        o->ino = ino;
        cfr_block *b = whole_file_block(ino);
        if (b && !b->opened && (o->backing_id = block_backing(b)) > 0) {
            o->block = b;
            b->opened = o;
        }
        *slot = o;
        stats.opened++;
    }
    cfr_opened *o = *slot;
    struct cfr_open_out out = {.fh = 0, .open_flags = CFR_FOPEN_NOFLUSH, .backing_id = 0};
    if (o->backing_id > 0) {
        out.open_flags |= CFR_FOPEN_PASSTHROUGH;
        out.backing_id = o->backing_id;
        /* The block left the table (evicted, refreshed, or its file changed and failed its
         * checks): the same backing file, as the kernel requires, but read() goes to READ
         * requests, which read what the snapshot serves now. (mmap() would still map the
         * backing file: the kernel gives it no other way while files are open on it.) */
        if (!o->block || whole_file_block(ino) != o->block || !backing_still_good(o->block))
            out.open_flags |= CFR_FOPEN_DIRECT_IO;
        stats.pt_opens++;
    } else {
        out.open_flags |= CFR_FOPEN_KEEP_CACHE;
        stats.cached_opens++;
    }
    o->count++;
    if (fuse_reply_buf(req, (const char *)&out, sizeof out) != 0)
        release_one(slot); /* the opener is gone: no RELEASE will come for this OPEN */
    pthread_mutex_unlock(&lock);
    return 1;
}

int cfr_try_release(fuse_req_t req, fuse_ino_t ino) {
    if (!stats.passthrough) return 0;
    pthread_mutex_lock(&lock);
    cfr_opened **slot = opened_slot(ino);
    if (*slot) release_one(slot);
    pthread_mutex_unlock(&lock);
    fuse_reply_err(req, 0);
    return 1;
}

/* ---- peer reads: READs of another worker's blocks, sent to it from here ----
 *
 * The reader's side of the block protocol, for the files a training job reads most: small ones,
 * one block each, owned by another worker. cachefs registers, for such a file's inode, a route
 * (cfr_register_peer_route()): one of the connections to the owner it handed over
 * (cfr_peer_open(): already handshaken, see cachefs/peer/client.py) and the request frame that
 * asks for the file's block. A READ of that inode the table cannot answer locally is then sent
 * from here: the frame, with an id of the connection's, is written to the owner's socket, and
 * the READ waits, unanswered, in the connection's pending list. cachefs's Python side waits for
 * the socket to be readable and calls cfr_peer_receive(), which reads the answers and checks
 * each as cachefs/peer/client.py does (status, length, chunk size, the xxh3 of every chunk
 * against the checksums the owner sent) and replies to its READ with the bytes it asks for.
 * Anything else hands the READ back to cachefs (cfr_peer_handback: the binding runs its Python
 * handler as if the READ had just come, which asks the owner through the Python client or reads
 * the store), so a peer problem never becomes a read error and no byte that failed a check is
 * ever replied:
 *   - a refusal or an error answer: that READ (and its route goes: the owner may have moved);
 *   - a fault (a wrong length or checksum, garbage, the connection ended, a send the socket
 *     did not take whole): every READ pending on the connection, which is closed for good
 *     (cachefs cools the peer down and opens another later);
 *   - no answer within cachefs's timeout, or the peer marked down by the Python client:
 *     cfr_peer_close().
 * Nothing here keeps the bytes: a reader's copy of another node's block is read through
 * (passive caching off), and the kernel's page cache keeps them. Routes are forgotten with the
 * inodes (cfr_forget_inodes(): a refreshed file has a new inode; the request names the version,
 * which the owner checks), bounded like the blocks (the oldest goes first), and a route of a
 * closed connection is dropped when next used. Everything runs on the FUSE loop's thread under
 * the table's mutex. */

/* Connections open at once: one per owner this process reads from (two while one replaces a
 * connection that failed), so a node reads from up to ~1,000 peers in C; the rest are read in
 * Python (cachefs/fs/native_peer_reads.py). A slot is ~100 bytes; each open one is an fd. */
#define PEER_CONNS 1024
#define PEER_PENDING_MAX CFR_PEER_PENDING_MAX /* more READs at once go to Python */
#define PEER_REFUSAL_MAX 4096       /* wire.MAX_REASON_LEN */
#define PEER_MIN_CHUNK 4096         /* peer.base.MIN_BLOCK_SIZE .. MAX_BLOCK_SIZE */
#define PEER_MAX_CHUNK (64u << 20)
#define PEER_STATUS_INTERNAL 6      /* the largest status wire.py knows */

typedef struct cfr_pending {
    struct cfr_pending *next;
    fuse_req_t req;
    uint64_t ino, fh, size, length;
    int64_t off;
    int64_t sent_ns;
    uint32_t id;
} cfr_pending;

typedef struct {
    int open;
    int fd;
    uint32_t generation;            /* routes name it; bumped when the slot closes */
    uint32_t next_id;
    uint64_t max_length;            /* the largest block a route on it may ask for */
    cfr_pending *first, *last;      /* in the order sent */
    uint64_t npending;
    unsigned char *buf;             /* received, not yet handled: buf[start:end] */
    size_t cap, start, end;
    int fault;                      /* a CFR_PEER_* reason once it is broken */
} cfr_conn;

typedef struct cfr_route {
    uint64_t ino;
    struct cfr_route *next;         /* chain of the by-inode table */
    struct cfr_route *older, *newer;
    uint32_t conn, generation;
    uint64_t length;                /* the block's bytes (the whole file) */
    size_t frame_len;
    unsigned char frame[];          /* the request, its id (bytes 0..4) set per send */
} cfr_route;

static cfr_conn conns[PEER_CONNS];
static table_t by_route;
static cfr_route *oldest_route, *newest_route;

static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static cfr_route *find_route(uint64_t ino) {
    if (!by_route.mask) return NULL;
    for (cfr_route *r = by_route.slots[slot_of(&by_route, ino)]; r; r = r->next)
        if (r->ino == ino) return r;
    return NULL;
}

static void remove_route(cfr_route *r) {
    cfr_route **p = (cfr_route **)&by_route.slots[slot_of(&by_route, r->ino)];
    while (*p != r) p = &(*p)->next;
    *p = r->next;
    if (r->older) r->older->newer = r->newer;
    else oldest_route = r->newer;
    if (r->newer) r->newer->older = r->older;
    else newest_route = r->older;
    stats.peer_routes--;
    free(r);
}

static int grow_routes(void) {
    if (by_route.mask && stats.peer_routes + 1 <= by_route.mask + 1) return 0;
    uint64_t size = by_route.mask ? (by_route.mask + 1) * 2 : 1024;
    void **slots = calloc(size, sizeof(void *));
    if (!slots) return -1;
    table_t bigger = {slots, size - 1};
    for (cfr_route *r = oldest_route; r; r = r->newer) {
        uint64_t s = slot_of(&bigger, r->ino);
        r->next = slots[s];
        slots[s] = r;
    }
    free(by_route.slots);
    by_route = bigger;
    return 0;
}

static void forget_routes(uint64_t lo, uint64_t hi) { /* under the mutex */
    cfr_route *r = oldest_route;
    while (r) {
        cfr_route *next = r->newer;
        if (r->ino >= lo && r->ino <= hi) remove_route(r);
        r = next;
    }
}

int cfr_peer_open(int fd, uint64_t max_length) {
    pthread_mutex_lock(&lock);
    int slot = -1;
    for (int i = 0; i < PEER_CONNS; i++)
        if (!conns[i].open) {
            slot = i;
            break;
        }
    if (slot >= 0) {
        cfr_conn *c = &conns[slot];
        uint32_t generation = c->generation;
        memset(c, 0, sizeof *c);
        c->generation = generation;
        c->open = 1;
        c->fd = fd;
        c->next_id = 1;
        c->max_length = max_length;
    }
    pthread_mutex_unlock(&lock);
    return slot;
}

int cfr_peer_slots(void) { return PEER_CONNS; }

int cfr_register_peer_route(uint64_t ino, int slot, const unsigned char *frame, size_t len,
                            uint64_t length) {
    if (slot < 0 || slot >= PEER_CONNS || len < PEER_REQUEST_HEAD || length == 0) return -1;
    cfr_route *r = malloc(sizeof(*r) + len);
    if (!r) return -1;
    r->ino = ino;
    r->length = length;
    r->frame_len = len;
    memcpy(r->frame, frame, len);
    pthread_mutex_lock(&lock);
    cfr_conn *c = &conns[slot];
    if (!c->open || c->fault || length > c->max_length || max_blocks == 0 ||
        grow_routes() != 0) {
        pthread_mutex_unlock(&lock);
        free(r);
        return -1;
    }
    r->conn = (uint32_t)slot;
    r->generation = c->generation;
    cfr_route *old = find_route(ino);
    if (old) remove_route(old);
    uint64_t s = slot_of(&by_route, ino);
    r->next = by_route.slots[s];
    by_route.slots[s] = r;
    r->newer = NULL;
    r->older = newest_route;
    if (newest_route) newest_route->newer = r;
    else oldest_route = r;
    newest_route = r;
    stats.peer_routes++;
    while (stats.peer_routes > max_blocks) remove_route(oldest_route);
    pthread_mutex_unlock(&lock);
    return 0;
}

/* Mark the connection broken: nothing more is sent on it, and its pending READs are handed
 * back by the next cfr_peer_receive(), which the shutdown wakes (the socket reads as ended). */
static void break_conn(cfr_conn *c, int why) {
    if (!c->fault) c->fault = why;
    shutdown(c->fd, SHUT_RDWR);
}

int cfr_try_peer_read(fuse_req_t req, fuse_ino_t ino, uint64_t fh, size_t size, off_t off) {
    if (off < 0 || !stats.peer_routes) return 0; /* a plain read: no route, no lock */
    pthread_mutex_lock(&lock);
    cfr_route *r = find_route(ino);
    if (!r) goto fall_through;
    cfr_conn *c = &conns[r->conn];
    if (!c->open || c->generation != r->generation || c->fault) {
        remove_route(r);
        goto fall_through;
    }
    if (c->npending >= PEER_PENDING_MAX) goto fall_through;
    cfr_pending *p = malloc(sizeof *p);
    if (!p) goto fall_through;
    p->id = c->next_id;
    c->next_id = c->next_id == UINT32_MAX ? 1 : c->next_id + 1;
    be_put(r->frame, p->id, 4);
    ssize_t sent = send(c->fd, r->frame, r->frame_len, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent != (ssize_t)r->frame_len) {
        free(p);
        /* Nothing sent to a full socket: this READ goes to Python, the connection stays. A
         * part of a frame garbles the stream: the connection is done. */
        if (!(sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)))
            break_conn(c, CFR_PEER_SEND_FAILED);
        goto fall_through;
    }
    p->req = req;
    p->ino = ino;
    p->fh = fh;
    p->size = size;
    p->off = off;
    p->length = r->length;
    p->sent_ns = monotonic_ns();
    p->next = NULL;
    if (c->last) c->last->next = p;
    else c->first = p;
    c->last = p;
    c->npending++;
    stats.peer_sent++;
    pthread_mutex_unlock(&lock);
    return 1;
fall_through:
    pthread_mutex_unlock(&lock);
    return 0;
}

static cfr_pending *take_pending(cfr_conn *c, uint32_t id) {
    cfr_pending *prev = NULL;
    for (cfr_pending *p = c->first; p; prev = p, p = p->next)
        if (p->id == id) {
            if (prev) prev->next = p->next;
            else c->first = p->next;
            if (c->last == p) c->last = prev;
            c->npending--;
            return p;
        }
    return NULL;
}

static void hand_back(cfr_pending *p, cfr_peer_handback *out, size_t *n) {
    cfr_peer_handback *h = &out[(*n)++];
    h->req = p->req;
    h->fh = p->fh;
    h->size = p->size;
    h->off = p->off;
    stats.peer_handbacks++;
    free(p);
}

/* Whether the OK answer `body` (its head's chunk size and checksums) is the whole block `p`
 * asked for with every chunk matching. */
static int answer_good(const cfr_pending *p, uint64_t chunk, const unsigned char *sums,
                       uint64_t sums_len, const unsigned char *body, uint64_t body_len) {
    if (body_len != p->length || chunk < PEER_MIN_CHUNK || chunk > PEER_MAX_CHUNK) return 0;
    uint64_t nchunks = (body_len + chunk - 1) / chunk;
    if (sums_len != nchunks * 8) return 0;
    for (uint64_t k = 0; k < nchunks; k++) {
        uint64_t at = k * chunk, n = body_len - at < chunk ? body_len - at : chunk;
        if (CFR_XXH3_64(body + at, n) != be_get(sums + 8 * k, 8)) return 0;
    }
    return 1;
}

/* Handle the whole answers at the front of the buffer; 0, or the reason the connection is
 * broken. */
static int handle_answers(cfr_conn *c, cfr_peer_handback *out, size_t *n) {
    while (c->end - c->start >= PEER_ANSWER_HEAD) {
        const unsigned char *h = c->buf + c->start;
        uint32_t id = (uint32_t)be_get(h, 4);
        unsigned status = h[4];
        uint64_t chunk = be_get(h + 8, 4), sums_len = be_get(h + 12, 4);
        uint64_t body_len = be_get(h + 16, 8);
        if (status == 0 ? body_len > c->max_length || sums_len > c->max_length
                        : status > PEER_STATUS_INTERNAL || sums_len || body_len > PEER_REFUSAL_MAX)
            return CFR_PEER_GARBAGE; /* we asked for no such answer: the stream is garbage */
        size_t need = PEER_ANSWER_HEAD + sums_len + body_len;
        if (c->end - c->start < need) { /* the rest has not arrived: make room for it */
            if (c->start + need > c->cap) {
                memmove(c->buf, c->buf + c->start, c->end - c->start);
                c->end -= c->start;
                c->start = 0;
            }
            return reserve(&c->buf, &c->cap, need) != 0 ? CFR_PEER_GARBAGE : 0;
        }
        cfr_pending *p = take_pending(c, id);
        const unsigned char *sums = h + PEER_ANSWER_HEAD, *body = sums + sums_len;
        c->start += need;
        if (!p) continue; /* its READ went back to Python already (timed out) */
        if (status != 0) {
            cfr_route *r = find_route(p->ino);
            if (r) remove_route(r);
            stats.peer_refused++;
            hand_back(p, out, n);
            continue;
        }
        if (!answer_good(p, chunk, sums, sums_len, body, body_len)) {
            hand_back(p, out, n);
            return CFR_PEER_BAD_ANSWER;
        }
        uint64_t begin = (uint64_t)p->off < p->length ? (uint64_t)p->off : p->length;
        uint64_t len = p->length - begin < p->size ? p->length - begin : p->size;
        /* An error here (the reader was interrupted) needs nothing from us. */
        fuse_reply_buf(p->req, (const char *)body + begin, len);
        stats.peer_reads++;
        stats.peer_read_bytes += len;
        free(p);
    }
    return 0;
}

/* Close the slot: every pending READ handed back (or, `fail`, answered EIO), the routes on it
 * dropped when next used. The socket stays the caller's. */
static void close_conn(cfr_conn *c, int fail, cfr_peer_handback *out, size_t *n) {
    while (c->first) {
        cfr_pending *p = c->first;
        c->first = p->next;
        if (fail) {
            fuse_reply_err(p->req, EIO);
            free(p);
        } else {
            hand_back(p, out, n);
        }
    }
    c->last = NULL;
    c->npending = 0;
    free(c->buf);
    c->buf = NULL;
    c->cap = c->start = c->end = 0;
    c->open = 0;
    c->generation++;
}

int cfr_peer_receive(int slot, cfr_peer_handback *out, size_t *handed, uint64_t *pending,
                     int64_t *oldest_age_ns) {
    *handed = 0;
    *pending = 0;
    *oldest_age_ns = 0;
    if (slot < 0 || slot >= PEER_CONNS) return CFR_PEER_CLOSED;
    pthread_mutex_lock(&lock);
    cfr_conn *c = &conns[slot];
    if (!c->open) {
        pthread_mutex_unlock(&lock);
        return CFR_PEER_CLOSED;
    }
    /* Read what has arrived (bounded: other tasks must run under a stream of answers). */
    for (int reads = 0; !c->fault && reads < 64; reads++) {
        if (c->cap - c->end < (64u << 10)) {
            if (c->start) { /* the unread bytes to the front */
                memmove(c->buf, c->buf + c->start, c->end - c->start);
                c->end -= c->start;
                c->start = 0;
            }
            if (c->cap - c->end < (64u << 10) && reserve(&c->buf, &c->cap, c->end + (1u << 20)))
                c->fault = CFR_PEER_GARBAGE;
            if (c->fault) break;
        }
        ssize_t got = recv(c->fd, c->buf + c->end, c->cap - c->end, MSG_DONTWAIT);
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            c->fault = got == 0 ? CFR_PEER_ENDED : CFR_PEER_RECV_FAILED;
            break;
        }
        c->end += (size_t)got;
        int why = handle_answers(c, out, handed);
        if (why) c->fault = why;
        if (c->start == c->end) c->start = c->end = 0;
    }
    int fault = c->fault;
    if (fault) close_conn(c, 0, out, handed);
    else if (c->first) {
        *pending = c->npending;
        *oldest_age_ns = monotonic_ns() - c->first->sent_ns;
    }
    pthread_mutex_unlock(&lock);
    return fault;
}

void cfr_peer_close(int slot, int fail, cfr_peer_handback *out, size_t *handed) {
    *handed = 0;
    if (slot < 0 || slot >= PEER_CONNS) return;
    pthread_mutex_lock(&lock);
    if (conns[slot].open) close_conn(&conns[slot], fail, out, handed);
    pthread_mutex_unlock(&lock);
}
