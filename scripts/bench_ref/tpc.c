// Benchmark reference, not part of the product: the design card's data-path shape in C,
// with no GIL, so `scripts/bench --paths ...,ref-c` can tell how much of a gap to HAProxy
// the shape itself costs on a machine and how much CPython adds (docs/performance.md).
//
// Shape, as in extractedprism/datapath/proxy.py and pipe.py: an acceptor thread hands each
// accepted socket to the most recently parked of 64 pre-started pipe threads (LIFO, each
// with its own semaphore); the pipe thread connects to the upstream, sets TCP_NODELAY on
// both sockets, makes them non-blocking, sleeps in poll() on both and moves bytes with
// splice() through its two reusable kernel pipes; EOF is passed on with shutdown(SHUT_WR).
// scripts/bench starts it with SCHED_BATCH, the product's default --pipe-sched.
//
// Flags: the ones scripts/bench passes (--endpoints IP:PORT --bind-address IP --bind-port N
// --health-port N); others are ignored. GET anything on the health port answers 200.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define POOL 64
#define CHUNK 65536
#define SPLICE_FLAGS (SPLICE_F_NONBLOCK | SPLICE_F_MOVE)

struct worker {
    sem_t go;
    int fd;
    struct worker *next;
};

static struct sockaddr_in up_addr;
static pthread_mutex_t stack_mu = PTHREAD_MUTEX_INITIALIZER;
static struct worker *idle;

static void nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Write n bytes from the kernel pipe to dst, waiting for POLLOUT when dst is full.
static int flush(int pipe_r, int dst, ssize_t n) {
    while (n > 0) {
        ssize_t w = splice(pipe_r, NULL, dst, NULL, (size_t)n, SPLICE_FLAGS);
        if (w < 0 && errno == EAGAIN) {
            struct pollfd o = {dst, POLLOUT, 0};
            poll(&o, 1, -1);
            continue;
        }
        if (w <= 0) return -1;
        n -= w;
    }
    return 0;
}

// Returns nonzero when the connection died with bytes possibly left in a kernel pipe:
// the caller must then replace its pipes, or the next connection would receive them.
static int serve(int c, int p[2][2]) {
    int u = socket(AF_INET, SOCK_STREAM, 0);
    if (u < 0 || connect(u, (struct sockaddr *)&up_addr, sizeof up_addr) < 0) {
        close(c);
        if (u >= 0) close(u);
        return 0;
    }
    nodelay(u);
    nodelay(c);
    fcntl(c, F_SETFL, O_NONBLOCK);
    fcntl(u, F_SETFL, O_NONBLOCK);
    int src[2] = {c, u}, dst[2] = {u, c}, eof[2] = {0, 0}, dead = 0;
    for (;;) {
        struct pollfd pf[2] = {{c, eof[0] ? 0 : POLLIN, 0}, {u, eof[1] ? 0 : POLLIN, 0}};
        if (poll(pf, 2, -1) < 0) break;
        for (int d = 0; d < 2 && !dead; d++) {
            if (!pf[d].revents) continue;
            ssize_t got = splice(src[d], NULL, p[d][1], NULL, CHUNK, SPLICE_FLAGS);
            if (got < 0) {
                if (errno != EAGAIN) dead = 1;
            } else if (got == 0) {
                eof[d] = 1;
                shutdown(dst[d], SHUT_WR);
            } else if (flush(p[d][0], dst[d], got) < 0) {
                dead = 1;
            }
        }
        if (dead || (eof[0] && eof[1])) break;
    }
    close(c);
    close(u);
    return dead;
}

static void new_pipes(int p[2][2]) {
    if (pipe2(p[0], O_NONBLOCK) < 0 || pipe2(p[1], O_NONBLOCK) < 0) abort();
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    int p[2][2];
    new_pipes(p);
    for (;;) {
        pthread_mutex_lock(&stack_mu);
        w->next = idle;
        idle = w;
        pthread_mutex_unlock(&stack_mu);
        while (sem_wait(&w->go) < 0) {
        }
        if (serve(w->fd, p)) {
            for (int d = 0; d < 2; d++) close(p[d][0]), close(p[d][1]);
            new_pipes(p);
        }
    }
    return NULL;
}

static void spawn(void) {
    struct worker *w = calloc(1, sizeof *w);
    sem_init(&w->go, 0, 0);
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setstacksize(&a, 256 * 1024);
    pthread_t t;
    if (pthread_create(&t, &a, worker_main, w) != 0) abort();
}

static struct worker *pop_worker(void) {
    struct worker *w = NULL;
    for (int spawned = 0;; spawned = 1) {
        pthread_mutex_lock(&stack_mu);
        w = idle;
        if (w) idle = w->next;
        pthread_mutex_unlock(&stack_mu);
        if (w) return w;
        if (!spawned) spawn();  // grows on demand, like the product's pool
        sched_yield();
    }
}

static void *health_main(void *arg) {
    int l = (int)(long)arg;
    static const char ok[] = "HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nok\n";
    for (;;) {
        int c = accept(l, NULL, NULL);
        if (c < 0) continue;
        char buf[1024];
        if (read(c, buf, sizeof buf) > 0 && write(c, ok, sizeof ok - 1) < 0) {
        }
        close(c);
    }
    return NULL;
}

static int listen_on(const char *host, int port) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1 || bind(l, (struct sockaddr *)&a, sizeof a) < 0 ||
        listen(l, 4096) < 0) {
        perror("listen");
        exit(2);
    }
    return l;
}

int main(int argc, char **argv) {
    const char *bind_host = "127.0.0.1";
    int port = 7445, hport = 7446, up_port = 0;
    char up_host[64] = "";
    for (int i = 1; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "--bind-address")) bind_host = argv[++i];
        else if (!strcmp(argv[i], "--bind-port")) port = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--health-port")) hport = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--endpoints")) sscanf(argv[++i], "%63[^:]:%d", up_host, &up_port);
    }
    up_addr.sin_family = AF_INET;
    up_addr.sin_port = htons(up_port);
    if (!up_port || inet_pton(AF_INET, up_host, &up_addr.sin_addr) != 1) {
        fprintf(stderr, "usage: tpc --endpoints IPv4:PORT [--bind-address IP] [--bind-port N] "
                        "[--health-port N]\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    int l = listen_on(bind_host, port), h = listen_on(bind_host, hport);
    pthread_t ht;
    pthread_create(&ht, NULL, health_main, (void *)(long)h);
    for (int i = 0; i < POOL; i++) spawn();
    for (;;) {
        int c = accept(l, NULL, NULL);
        if (c < 0) {
            if (errno == EMFILE || errno == ENFILE) usleep(100000);
            continue;
        }
        struct worker *w = pop_worker();
        w->fd = c;
        sem_post(&w->go);
    }
}
