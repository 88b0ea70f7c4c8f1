/* _relay: the native byte relay of one connection (pipe.py's fallback is the Python loop).
 *
 * relay(client_fd, upstream_fd, pipes, counters[, pin]) -> (errno, left_up, left_down, first_eof)
 *
 * Copies both directions between two connected sockets until both are done, with the
 * GIL released for the whole call, exactly as a blocking socket.sendfile() would: the
 * pipe thread that called it sleeps in poll() and no other thread has to hand it the
 * GIL for every readiness event (docs/performance.md, issue 16).
 *
 *   pipes     (up_r, up_w, down_r, down_w): the calling thread's two non-blocking
 *             kernel pipes, reused across its connections; bytes go socket -> pipe ->
 *             socket with splice(), never through user space.
 *   counters  a writable buffer of two or three aligned uint64 (bytes client->upstream,
 *             upstream->client, and, when there is a third, the client->upstream count
 *             at the upstream's latest read: what the upstream's bytes answer), updated
 *             live so other threads can read them (the stall check, upstreams/activity.py,
 *             reads the third; one store per read, none per byte).
 *   pin       the CPU + 1 the calling thread is pinned to (--gil-cpu), or 0: see
 *             UNPIN_AFTER below.
 *
 * Returns errno 0 when both directions ended with EOF (each passed on with
 * shutdown(SHUT_WR) after the bytes read before it were written), else the errno of
 * the first failure (a reset, say): the caller then resets both peers (SO_LINGER 0).
 * left_up/left_down are the bytes still in each kernel pipe: nonzero means the caller
 * must drop those pipes, or the thread's next connection would receive them.
 * first_eof: which side said EOF first (1 client, 2 upstream, 0 neither), for the
 * connection's close log line.
 * Another thread ends the call by shutting either socket down (shutdown(SHUT_RDWR)
 * wakes poll: reads see EOF, writes fail). The caller owns and closes both sockets;
 * this only makes them O_NONBLOCK (Python's socket objects are not told; the caller
 * does no blocking I/O on them afterwards).
 *
 * Two small helpers keep the GIL on purpose: every GIL release is a chance for one of
 * dozens of busy pipe threads to take it, and winning it back costs a context switch.
 * They only make calls that cannot block:
 *
 * connect(family, host, port, options[, client_fd]) -> (fd, errno, first, sent)
 *   a non-blocking TCP socket with the options set, its connect started (errno 0:
 *   connected already, EINPROGRESS, or the failure: then fd is already closed and -1).
 *   With client_fd, a connect done at once also does take_first(client_fd, fd) (below),
 *   so the client's request is on its way before Python builds anything for the
 *   connection; else first, sent = None, 0.
 * close_pair(fd1, fd2, reset): close both (SO_LINGER 0 first when reset, so each peer
 *   gets a reset); close() of a socket without a lingering wait returns at once.
 *
 * first_answer(client_fd, upstream_fd, timeout_ms, first[, sent]) -> (found, first): the
 * first answer (datapath/first_answer.py) in one call with the GIL released: wait for the
 * client's first bytes (unless ``first`` is given), send them on, and, only when they are
 * a complete TLS ClientHello record, give the upstream ``timeout_ms`` (the hedge delay) to
 * answer or close while watching the client. found: 0 SILENT (the caller may hedge the
 * ClientHello), 1 ANSWERED (or nothing to judge: relay), 2 LEFT (the client closed or
 * reset during the wait: close both, charge nobody).
 *
 * judged_relay(client_fd, upstream_fd, pipes, counters, timeout_ms, first[, pin[, sent]])
 *   -> (found, first, errno, left_up, left_down, first_eof)
 *   first_answer and relay in one call, so a new connection costs its pipe thread one
 *   GIL round trip fewer (issue 16, item 3): when the upstream answers (or there is
 *   nothing to judge), the relay starts at once, without going back to Python in between.
 *   sent: how many of ``first`` went to this upstream already (take_first, below).
 *   found=SILENT or LEFT: nothing was relayed and nothing went back to the client; both
 *   sockets are untouched apart from O_NONBLOCK, and ``first`` holds the client's first
 *   bytes (all of them with this upstream). found=ANSWERED: relayed as relay() does (the
 *   first bytes are counted in counters[0]); ``first`` is None.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (64 * 1024) /* a default kernel pipe's capacity */
/* A direction that has moved GROW_AFTER bytes is a bulk transfer: its kernel pipe grows
 * to BIG_PIPE, so each splice moves up to that much (16 times fewer syscalls per byte;
 * HAProxy's tune.pipesize). The pipe shrinks back when the call ends: a thread's pipes
 * outlive its connections, and the kernel caps what a user's pipes may hold in all
 * (fs.pipe-user-pages-soft), beyond which every new pipe gets a single page. */
#define GROW_AFTER (4 * 1024 * 1024)
#define BIG_PIPE (1024 * 1024)
#define SPLICE_FLAGS (SPLICE_F_MOVE | SPLICE_F_NONBLOCK)
/* Nothing, except in the store-order test's own build (tests/net/test_relay_counters.py
 * compiles this file with a pause here, so a reader can land between the two stores). */
#ifndef RELAY_BETWEEN_STORES
#define RELAY_BETWEEN_STORES() ((void)0)
#endif
/* Reported whatever was asked for; the next splice on that fd says what happened. */
#define WOKE (POLLERR | POLLHUP | POLLNVAL)

/* --gil-cpu (sched.py): a pipe thread pinned to the GIL's CPU passes pin = that CPU + 1.
 * A connection still busy after UNPIN_AFTER relay wake-ups is let out to every CPU the
 * process may use (all_cpus, read at import, before any thread was pinned) for the rest
 * of the call, since the bytes need no GIL; it is pinned back before the call returns. */
#define UNPIN_AFTER 16
static cpu_set_t all_cpus;
static int have_all_cpus;

/* One direction, src -> dst. */
struct half {
    int src, dst;         /* sockets */
    int pipe_r, pipe_w;   /* this direction's kernel pipe */
    size_t pending;       /* bytes read into the pipe, not yet written to dst */
    int eof;              /* src said EOF */
    int shut;             /* EOF passed on to dst: this direction is finished */
    uint64_t *count;      /* live byte counter in the caller's buffer */
    int side;             /* 1: reads the client, 2: reads the upstream */
    int *first_eof;       /* shared by both directions */
    size_t chunk;         /* bytes per splice: the pipe's capacity */
    int grown;            /* 1 grown to BIG_PIPE, -1 the kernel refused, 0 not yet */
    uint64_t *answered;   /* the upstream's half: the client count at its latest read */
    const uint64_t *asked; /* ... which is the other half's counter (NULL: not kept) */
};

static int set_nonblocking(int fd) {
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0) return -1;
    return (flags & O_NONBLOCK) ? 0 : fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

/* Pass EOF on once everything read before it is out. 0, or an errno. */
static int pass_eof(struct half *h) {
    if (!h->eof || h->pending || h->shut) return 0;
    h->shut = 1;
    /* ENOTCONN: the peer is gone already, and the other direction will say so. */
    if (shutdown(h->dst, SHUT_WR) < 0 && errno != ENOTCONN) return errno;
    return 0;
}

/* Write what the pipe holds; stops at EAGAIN (poll then waits for POLLOUT). */
static int flush(struct half *h) {
    while (h->pending) {
        ssize_t n = splice(h->pipe_r, NULL, h->dst, NULL, h->pending, SPLICE_FLAGS);
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno == EAGAIN ? 0 : errno;
        }
        h->pending -= (size_t)n;
    }
    return pass_eof(h);
}

static void grow(struct half *h) {
    int size = fcntl(h->pipe_w, F_SETPIPE_SZ, BIG_PIPE);
    h->grown = size >= BIG_PIPE ? 1 : -1;
    if (h->grown > 0) h->chunk = (size_t)size;
}

/* Back to a default pipe once empty (a pipe still holding bytes is dropped by the caller). */
static void shrink(struct half *h) {
    if (h->grown > 0 && !h->pending) (void)fcntl(h->pipe_w, F_SETPIPE_SZ, CHUNK);
}

/* src is readable: move what it has on, until it is empty, dst is full, or EOF. */
static int pump(struct half *h) {
    while (!h->eof && !h->pending) {
        ssize_t n = splice(h->src, NULL, h->pipe_w, NULL, h->chunk, SPLICE_FLAGS);
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno == EAGAIN ? 0 : errno;
        }
        if (n == 0) {
            h->eof = 1;
            if (!*h->first_eof) *h->first_eof = h->side;
            return pass_eof(h);
        }
        h->pending = (size_t)n;
        /* The answered mark before the count, the count with release order: a reader
         * (upstreams/stalls.py reads up, down, then answered) that sees the upstream's
         * new bytes sees what they answer too. The other order let a sample between the
         * two stores see new bytes down with an old mark: unanswered bytes, a stall clock
         * started that nothing later cleared (issue 37, finding 12). */
        if (h->answered) {
            __atomic_store_n(h->answered, *h->asked, __ATOMIC_RELAXED);
            RELAY_BETWEEN_STORES();
        }
        __atomic_store_n(h->count, *h->count + (uint64_t)n, __ATOMIC_RELEASE);
        int err = flush(h);
        if (err) return err;
        if ((size_t)n < h->chunk) break; /* a short read: src is (almost surely) empty */
        if (!h->grown && *h->count >= GROW_AFTER) grow(h);
    }
    return 0;
}

/* What fd needs from poll: input for the direction it feeds, output for the one that
 * waits on it. An fd needing nothing is left out (-1), or its HUP would spin poll. */
static void interest(struct pollfd *p, int fd, const struct half *in, const struct half *out) {
    short ev = 0;
    if (!in->eof && !in->pending) ev |= POLLIN;
    if (out->pending) ev |= POLLOUT;
    p->fd = ev ? fd : -1;
    p->events = ev;
    p->revents = 0;
}

/* Move the calling thread off the GIL's CPU, then allow it every CPU. Only allowing them
 * would leave it where it is: 64 keep-alive connections let out that way still shared
 * one CPU (keep-alive p99 42 ms against 6.6 ms unpinned); the move spreads them and
 * the kernel's balancing takes it from there. 1 when it was let out. */
static int let_out(int gil_cpu) {
    cpu_set_t others = all_cpus;
    CPU_CLR(gil_cpu, &others);
    if (CPU_COUNT(&others) > 0) (void)sched_setaffinity(0, sizeof others, &others);
    return sched_setaffinity(0, sizeof all_cpus, &all_cpus) == 0;
}

static int run_loop(struct half h[2], int pin, int *unpinned) {
    int c = h[0].src, u = h[1].src;
    int wakes = 0;
    while (!(h[0].shut && h[1].shut)) {
        struct pollfd pf[2];
        interest(&pf[0], c, &h[0], &h[1]);
        interest(&pf[1], u, &h[1], &h[0]);
        if (poll(pf, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (pin && ++wakes == UNPIN_AFTER) *unpinned = let_out(pin - 1);
        for (int d = 0; d < 2; d++) {
            /* Direction d writes to pf[1-d]'s fd and reads from pf[d]'s. A HUP or ERR
             * wakes whichever call will report it: the write's or the read's. */
            int err = 0;
            if ((pf[1 - d].events & POLLOUT) && (pf[1 - d].revents & (POLLOUT | WOKE)))
                err = flush(&h[d]);
            if (!err && (pf[d].events & POLLIN) && (pf[d].revents & (POLLIN | WOKE)))
                err = pump(&h[d]);
            if (err) return err;
        }
    }
    return 0;
}

static int run(struct half h[2], int pin) {
    int unpinned = 0;
    int err = run_loop(h, pin && have_all_cpus, &unpinned);
    shrink(&h[0]);
    shrink(&h[1]);
    if (unpinned) { /* back to the GIL's CPU before Python runs again on this thread */
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(pin - 1, &one);
        (void)sched_setaffinity(0, sizeof one, &one);
    }
    return err;
}

/* The two directions of one call, and the checks relay() and judged_relay() share: 0, or
 * -1 with the ValueError set (counters released). */
static int setup(struct half h[2], int cfd, int ufd, const int p[4], Py_buffer *counters,
                 int pin, int *first_eof) {
    if (counters->len < (Py_ssize_t)(2 * sizeof(uint64_t)) ||
        (uintptr_t)counters->buf % _Alignof(uint64_t) || pin < 0 || pin > CPU_SETSIZE) {
        PyBuffer_Release(counters);
        PyErr_SetString(PyExc_ValueError,
                        "counters must be 16 or 24 aligned bytes, pin a CPU + 1");
        return -1;
    }
    uint64_t *count = counters->buf;
    int third = counters->len >= (Py_ssize_t)(3 * sizeof(uint64_t));
    struct half up = {cfd, ufd, p[0], p[1], 0, 0, 0, &count[0], 1, first_eof, CHUNK, 0,
                      NULL, NULL};
    struct half down = {ufd, cfd, p[2], p[3], 0, 0, 0, &count[1], 2, first_eof, CHUNK, 0,
                        third ? &count[2] : NULL, third ? &count[0] : NULL};
    h[0] = up;
    h[1] = down;
    return 0;
}

static PyObject *relay(PyObject *self, PyObject *args) {
    (void)self;
    int cfd, ufd, p[4], pin = 0, first_eof = 0;
    Py_buffer counters;
    struct half h[2];
    if (!PyArg_ParseTuple(args, "ii(iiii)w*|i:relay", &cfd, &ufd, &p[0], &p[1], &p[2], &p[3],
                          &counters, &pin) ||
        setup(h, cfd, ufd, p, &counters, pin, &first_eof) < 0)
        return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = (set_nonblocking(cfd) < 0 || set_nonblocking(ufd) < 0) ? errno : run(h, pin);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&counters);
    return Py_BuildValue("(inni)", err, (Py_ssize_t)h[0].pending, (Py_ssize_t)h[1].pending,
                         first_eof);
}

static PyObject *take_first_fds(int cfd, int ufd);

static PyObject *connect_start(PyObject *self, PyObject *args) {
    (void)self;
    int family, port, client_fd = -1;
    const char *host;
    PyObject *opts;
    if (!PyArg_ParseTuple(args, "isiO!|i:connect", &family, &host, &port, &PyTuple_Type, &opts,
                          &client_fd))
        return NULL;
    struct sockaddr_storage sa;
    socklen_t len;
    memset(&sa, 0, sizeof sa);
    if (family == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)&sa;
        a->sin_family = AF_INET;
        a->sin_port = htons((uint16_t)port);
        len = sizeof *a;
        if (inet_pton(AF_INET, host, &a->sin_addr) != 1) goto bad_address;
    } else if (family == AF_INET6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&sa;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)port);
        len = sizeof *a;
        if (inet_pton(AF_INET6, host, &a->sin6_addr) != 1) goto bad_address;
    } else {
        goto bad_address;
    }
    int fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return PyErr_SetFromErrno(PyExc_OSError);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(opts); i++) {
        int level, name, value;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(opts, i), "iii", &level, &name, &value)) {
            close(fd);
            return NULL;
        }
        /* As apply_sockopts: an option this kernel refuses is skipped. */
        (void)setsockopt(fd, level, name, &value, sizeof value);
    }
    int err = connect(fd, (struct sockaddr *)&sa, len) < 0 ? errno : 0;
    if (err == EINPROGRESS) {
        /* On a fast path (loopback, a near host) the handshake is often done by now:
         * look once without waiting, so the caller need not release the GIL to poll. */
        struct pollfd p = {fd, POLLOUT, 0};
        socklen_t elen = sizeof err;
        if (poll(&p, 1, 0) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) < 0)
            err = errno;
    }
    if (err && err != EINPROGRESS) {
        close(fd);
        fd = -1;
    }
    /* Connected at once: the client's request goes on now, in the same call (take_first). */
    PyObject *first = err || client_fd < 0 ? Py_BuildValue("(On)", Py_None, (Py_ssize_t)0)
                                           : take_first_fds(client_fd, fd);
    if (first == NULL) {
        if (fd >= 0) close(fd);
        return NULL;
    }
    PyObject *out = Py_BuildValue("(iiOO)", fd, err, PyTuple_GET_ITEM(first, 0),
                                  PyTuple_GET_ITEM(first, 1));
    Py_DECREF(first);
    return out;
bad_address:
    PyErr_Format(PyExc_ValueError, "not a numeric address: %s", host);
    return NULL;
}

static PyObject *close_pair(PyObject *self, PyObject *args) {
    (void)self;
    int fds[2], reset;
    if (!PyArg_ParseTuple(args, "iip:close_pair", &fds[0], &fds[1], &reset)) return NULL;
    struct linger rst = {1, 0};
    for (int i = 0; i < 2; i++) {
        if (fds[i] < 0) continue;
        if (reset) (void)setsockopt(fds[i], SOL_SOCKET, SO_LINGER, &rst, sizeof rst);
        close(fds[i]);
    }
    Py_RETURN_NONE;
}

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* A millisecond timeout from Python, held to what poll() takes: negative -> 0, more than
 * an int -> INT_MAX (about 596 hours), never an OverflowError on every connection. */
static int clamp_ms(long long ms) {
    return ms < 0 ? 0 : ms > INT_MAX ? INT_MAX : (int)ms;
}

#define FIRST_MAX (16 * 1024) /* a TLS ClientHello is one record */

/* What the first answer found (first_answer_nogil; proxy.py's first_answer.py says why). */
#define SILENT 0   /* the upstream said nothing within the delay: the caller may hedge */
#define ANSWERED 1 /* it answered or closed, or there is nothing to judge: relay */
#define LEFT 2     /* the client closed or reset while it waited: close both */

/* A complete TLS ClientHello record and nothing else (record type 22, handshake type 1,
 * the whole record): the only first bytes another upstream may ever be given. */
static int is_client_hello(const char *b, Py_ssize_t n) {
    const unsigned char *u = (const unsigned char *)b;
    return n >= 6 && n <= FIRST_MAX && u[0] == 22 && u[5] == 1 &&
           5 + (((Py_ssize_t)u[3] << 8) | u[4]) == n;
}

/* The client became readable during the wait: LEFT on EOF or a reset, else ANSWERED (it
 * sent more, so there is nothing left to hedge: the relay takes it). */
static int client_moved(int cfd) {
    char c;
    ssize_t r = recv(cfd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) ? LEFT : ANSWERED;
}

/* SILENT, ANSWERED or LEFT; *n is the length of the first bytes in buf, of which the first
 * ``sent`` went to this upstream already (take_first). Only a ClientHello is judged: any
 * other first bytes are sent on and relayed at once (they may never go elsewhere). */
static int first_answer_nogil(int cfd, int ufd, int timeout_ms, char *buf, Py_ssize_t *n,
                              int have_first, Py_ssize_t sent) {
    if (!have_first) {
        struct pollfd p[2] = {{cfd, POLLIN, 0}, {ufd, POLLIN, 0}};
        int r;
        do r = poll(p, 2, timeout_ms); while (r < 0 && errno == EINTR);
        if (r <= 0 || p[1].revents) return ANSWERED; /* nothing from the client, or upstream first */
        ssize_t got = recv(cfd, buf, FIRST_MAX, MSG_DONTWAIT);
        if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) return LEFT;
        if (got < 0) return ANSWERED; /* nothing after all: the relay waits for it */
        *n = got;
    }
    int64_t deadline = now_ms() + timeout_ms;
    for (Py_ssize_t off = sent; off < *n;) {
        ssize_t w = send(ufd, buf + off, (size_t)(*n - off), MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w >= 0) {
            off += w;
        } else if (errno == EAGAIN || errno == EINTR) {
            /* The bytes belong to this upstream now, whatever it does: finish sending
             * them, however long that takes (as the relay would). */
            struct pollfd p = {ufd, POLLOUT, 0};
            if (poll(&p, 1, -1) < 0 && errno != EINTR) return ANSWERED;
        } else {
            return ANSWERED; /* the relay reports the upstream's error */
        }
    }
    if (!is_client_hello(buf, *n)) return ANSWERED;
    for (;;) {
        int64_t left = deadline - now_ms();
        if (left <= 0) return SILENT;
        struct pollfd p[2] = {{cfd, POLLIN, 0}, {ufd, POLLIN, 0}};
        int r = poll(p, 2, (int)left);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 || p[1].revents) return ANSWERED;
        if (p[0].revents) return client_moved(cfd);
    }
}

/* ``first`` is None or bytes of at most FIRST_MAX, ``sent`` of them already sent: 0, or -1
 * with the ValueError set. */
static int check_first(PyObject *first, Py_ssize_t sent) {
    if (first == Py_None ||
        (PyBytes_Check(first) && PyBytes_GET_SIZE(first) <= FIRST_MAX && sent >= 0 &&
         sent <= PyBytes_GET_SIZE(first)))
        return 0;
    PyErr_SetString(PyExc_ValueError, "first must be None or at most 16 KiB of bytes");
    return -1;
}

/* Where first_answer_nogil finds or reads the first bytes. Given ones are sent from the
 * bytes object itself (immutable, and the argument tuple keeps it alive while the GIL is
 * released): no copy. Else a buffer to read them from the client, on the heap rather than
 * the small pipe-thread stack (see take_first), returned in *owned for the caller to free
 * (PyMem_RawFree(NULL) does nothing). NULL: out of memory. */
static char *first_buffer(PyObject *first, char **owned) {
    if (first != Py_None) return PyBytes_AS_STRING(first);
    return *owned = PyMem_RawMalloc(FIRST_MAX);
}

static PyObject *py_is_client_hello(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*:is_client_hello", &b)) return NULL;
    int yes = is_client_hello(b.buf, b.len);
    PyBuffer_Release(&b);
    return PyBool_FromLong(yes);
}

static PyObject *first_answer(PyObject *self, PyObject *args) {
    (void)self;
    int cfd, ufd;
    long long timeout;
    Py_ssize_t sent = 0;
    PyObject *first;
    if (!PyArg_ParseTuple(args, "iiLO|n:first_answer", &cfd, &ufd, &timeout, &first,
                          &sent) ||
        check_first(first, sent) < 0)
        return NULL;
    int timeout_ms = clamp_ms(timeout);
    int have = first != Py_None;
    char *owned = NULL, *buf = first_buffer(first, &owned);
    if (buf == NULL) return PyErr_NoMemory();
    Py_ssize_t n = have ? PyBytes_GET_SIZE(first) : 0;
    int found;
    Py_BEGIN_ALLOW_THREADS
    found = first_answer_nogil(cfd, ufd, timeout_ms, buf, &n, have, have ? sent : 0);
    Py_END_ALLOW_THREADS
    PyObject *out = have ? Py_BuildValue("(iO)", found, first)
                         : Py_BuildValue("(iy#)", found, buf, n);
    PyMem_RawFree(owned);
    return out;
}

/* take_first(client_fd, upstream_fd) -> (first, sent): the client's first bytes, if they
 * are there already, read and sent on at once, keeping the GIL (two calls that cannot
 * block), so the upstream starts on them while Python attaches the connection;
 * ``sent`` of them went out (a full send buffer sends the rest later). (None, 0): none
 * yet, or EOF or an error, which the relay sees. */
static PyObject *take_first(PyObject *self, PyObject *args) {
    (void)self;
    int cfd, ufd;
    if (!PyArg_ParseTuple(args, "ii:take_first", &cfd, &ufd)) return NULL;
    return take_first_fds(cfd, ufd);
}

static PyObject *take_first_fds(int cfd, int ufd) {
    /* On the heap and freed at once: a 16 KiB stack array would make every pipe thread
     * keep one more resident stack page (23.8 -> 19.9 KiB per idle connection). */
    char *buf = PyMem_RawMalloc(FIRST_MAX);
    if (buf == NULL) return PyErr_NoMemory();
    ssize_t got = recv(cfd, buf, FIRST_MAX, MSG_DONTWAIT);
    PyObject *out;
    if (got <= 0) {
        out = Py_BuildValue("(On)", Py_None, (Py_ssize_t)0);
    } else {
        ssize_t w = send(ufd, buf, (size_t)got, MSG_DONTWAIT | MSG_NOSIGNAL);
        out = Py_BuildValue("(y#n)", buf, (Py_ssize_t)got, (Py_ssize_t)(w > 0 ? w : 0));
    }
    PyMem_RawFree(buf);
    return out;
}

static PyObject *judged_relay(PyObject *self, PyObject *args) {
    (void)self;
    int cfd, ufd, p[4], pin = 0, first_eof = 0;
    long long timeout;
    Py_ssize_t sent = 0;
    Py_buffer counters;
    PyObject *first;
    struct half h[2];
    if (!PyArg_ParseTuple(args, "ii(iiii)w*LO|in:judged_relay", &cfd, &ufd, &p[0], &p[1],
                          &p[2], &p[3], &counters, &timeout, &first, &pin, &sent) ||
        setup(h, cfd, ufd, p, &counters, pin, &first_eof) < 0)
        return NULL;
    int timeout_ms = clamp_ms(timeout);
    if (check_first(first, sent) < 0) {
        PyBuffer_Release(&counters);
        return NULL;
    }
    int have = first != Py_None;
    uint64_t *count = counters.buf;
    char *owned = NULL, *buf = first_buffer(first, &owned);
    if (buf == NULL) {
        PyBuffer_Release(&counters);
        return PyErr_NoMemory();
    }
    Py_ssize_t n = have ? PyBytes_GET_SIZE(first) : 0;
    int err = 0, found = ANSWERED;
    Py_BEGIN_ALLOW_THREADS
    if (set_nonblocking(cfd) < 0 || set_nonblocking(ufd) < 0) {
        err = errno;
    } else {
        found = first_answer_nogil(cfd, ufd, timeout_ms, buf, &n, have, have ? sent : 0);
        if (found == ANSWERED) {
            /* Not needed for the relay: freed now, not at its end, or each long-lived
             * connection would keep a touched page (issue 16's idle-memory target). */
            PyMem_RawFree(owned);
            owned = NULL;
            /* What went on before the relay: the first bytes (all of them, when answered). */
            __atomic_store_n(&count[0], count[0] + (uint64_t)n, __ATOMIC_RELAXED);
            /* The upstream answered, so its socket is readable: move the answer now
             * instead of asking poll first (one system call fewer per connection). */
            err = pump(&h[1]);
            if (!err) err = run(h, pin);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&counters);
    PyObject *out;
    if (found != ANSWERED && have) /* the same bytes: the hedge may need them */
        out = Py_BuildValue("(iOinni)", found, first, 0, (Py_ssize_t)0, (Py_ssize_t)0, 0);
    else if (found != ANSWERED)
        out = Py_BuildValue("(iy#inni)", found, buf, n, 0, (Py_ssize_t)0, (Py_ssize_t)0, 0);
    else
        out = Py_BuildValue("(iOinni)", ANSWERED, Py_None, err, (Py_ssize_t)h[0].pending,
                            (Py_ssize_t)h[1].pending, first_eof);
    PyMem_RawFree(owned);
    return out;
}

static PyMethodDef methods[] = {
    {"relay", relay, METH_VARARGS,
     "relay(client_fd, upstream_fd, (up_r, up_w, down_r, down_w), counters[, pin]) -> "
     "(errno, left_up, left_down, first_eof)\n\nCopy both directions until both end (GIL released)."},
    {"connect", connect_start, METH_VARARGS,
     "connect(family, host, port, options[, client_fd]) -> (fd, errno, first, sent): "
     "non-blocking connect started; connected at once, take_first(client_fd, fd) too."},
    {"first_answer", first_answer, METH_VARARGS,
     "first_answer(client_fd, upstream_fd, timeout_ms, first[, sent]) -> (found, first): "
     "0 silent, 1 answered (or not judged), 2 the client left"},
    {"is_client_hello", py_is_client_hello, METH_VARARGS,
     "is_client_hello(data) -> bool: data is one complete TLS ClientHello record"},
    {"take_first", take_first, METH_VARARGS,
     "take_first(client_fd, upstream_fd) -> (first, sent): first bytes read and sent on."},
    {"judged_relay", judged_relay, METH_VARARGS,
     "judged_relay(client_fd, upstream_fd, pipes, counters, timeout_ms, first[, pin[, sent]]) "
     "-> "
     "(found, first, errno, left_up, left_down, first_eof)\n\nfirst_answer, then relay "
     "when answered, in one call (GIL released)."},
    {"close_pair", close_pair, METH_VARARGS,
     "close_pair(fd1, fd2, reset): close both sockets (SO_LINGER 0 first if reset)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_relay", "Native splice relay for one connection.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__relay(void) {
    /* Imported by the main thread at start, before any pipe thread is pinned. */
    have_all_cpus = sched_getaffinity(0, sizeof all_cpus, &all_cpus) == 0;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "UNPIN_AFTER_WAKEUPS", UNPIN_AFTER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
