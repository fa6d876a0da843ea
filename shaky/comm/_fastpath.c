/* The UDP data plane's per-datagram work in C, called through ctypes by shaky/comm/udp/ (which falls back
 * to Python where this library was not built): tags for many datagrams in one call, and the receive path:
 * many (coalesced) datagrams a system call, each checked, tagged and placed where its round puts it, without
 * returning to Python per datagram. ctypes releases the GIL for the length of each call.
 *
 * The tag (wire version 2, shaky/comm/udp/wire.py) is AES-256-GMAC: the GCM tag of an empty plaintext with the
 * datagram's header and payload as associated data. Its key is the sender's for that round,
 * HMAC-SHA256(key, "shaky udp gmac\0" || run || sender || round) (little-endian 8, 2 and 8 bytes, read from the
 * header), and its 12-byte nonce phase || flags || block || segment || 0 0 (1, 1, 4, 4, 2 bytes): within a
 * sender's round every datagram it tags has its own nonce, and the same nonce only ever tags the same bytes (a
 * phase-2 average goes to every rank as one message). tests/test_udp.py checks the bytes against OpenSSL's
 * EVP AES-256-GCM called from Python.
 */
#define _GNU_SOURCE
#define OPENSSL_SUPPRESS_DEPRECATED
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#if defined(__x86_64__) || defined(__i386__)
#define SHAKY_X86 1
#include <immintrin.h>
#endif
#include <openssl/aes.h>
#include <openssl/crypto.h>
#include <openssl/modes.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif

#define SHAKY_TAG_BYTES 16
#define SHAKY_HEADER_BYTES 36
#define SHAKY_VERSION 2
#define SHAKY_KEY_SLOTS 64
#define SHAKY_MAX_MSGS 64

/* AES-256 on one block with the CPU's AES instructions where it has them (the GCM context calls it twice a
 * datagram: the key's hash subkey once, then one block a nonce), else OpenSSL's AES_encrypt. The round keys are
 * kept as bytes (the context's buffer comes from Python, 16-byte alignment is not promised). On a CPU that is not
 * x86 the AES instructions are not compiled at all and OpenSSL's AES_encrypt does every block. */
typedef struct {
    uint8_t rk[15 * 16];
    AES_KEY fallback;
} shaky_aes;

static int have_aesni = -1;

#ifdef SHAKY_X86
__attribute__((target("aes,sse2"))) static __m128i expand_a(__m128i t1, __m128i t2) {
    __m128i t4;
    t2 = _mm_shuffle_epi32(t2, 0xff);
    t4 = _mm_slli_si128(t1, 4); t1 = _mm_xor_si128(t1, t4);
    t4 = _mm_slli_si128(t4, 4); t1 = _mm_xor_si128(t1, t4);
    t4 = _mm_slli_si128(t4, 4); t1 = _mm_xor_si128(t1, t4);
    return _mm_xor_si128(t1, t2);
}

__attribute__((target("aes,sse2"))) static __m128i expand_b(__m128i t1, __m128i t3) {
    __m128i t2 = _mm_shuffle_epi32(_mm_aeskeygenassist_si128(t1, 0), 0xaa), t4;
    t4 = _mm_slli_si128(t3, 4); t3 = _mm_xor_si128(t3, t4);
    t4 = _mm_slli_si128(t4, 4); t3 = _mm_xor_si128(t3, t4);
    t4 = _mm_slli_si128(t4, 4); t3 = _mm_xor_si128(t3, t4);
    return _mm_xor_si128(t3, t2);
}

#define SHAKY_EXPAND(i, rcon) \
    t1 = expand_a(t1, _mm_aeskeygenassist_si128(t3, rcon)); _mm_storeu_si128((__m128i *)(rk + 16 * (i)), t1); \
    if ((i) < 14) { t3 = expand_b(t1, t3); _mm_storeu_si128((__m128i *)(rk + 16 * ((i) + 1)), t3); }

__attribute__((target("aes,sse2"))) static void aesni_expand(const uint8_t *key, uint8_t *rk) {
    __m128i t1 = _mm_loadu_si128((const __m128i *)key), t3 = _mm_loadu_si128((const __m128i *)(key + 16));
    _mm_storeu_si128((__m128i *)rk, t1);
    _mm_storeu_si128((__m128i *)(rk + 16), t3);
    SHAKY_EXPAND(2, 0x01) SHAKY_EXPAND(4, 0x02) SHAKY_EXPAND(6, 0x04) SHAKY_EXPAND(8, 0x08)
    SHAKY_EXPAND(10, 0x10) SHAKY_EXPAND(12, 0x20) SHAKY_EXPAND(14, 0x40)
}

__attribute__((target("aes,sse2"))) static void aesni_block(const unsigned char in[16], unsigned char out[16],
                                                            const void *key) {
    const uint8_t *rk = ((const shaky_aes *)key)->rk;
    __m128i m = _mm_xor_si128(_mm_loadu_si128((const __m128i *)in), _mm_loadu_si128((const __m128i *)rk));
    for (int i = 1; i < 14; i++) m = _mm_aesenc_si128(m, _mm_loadu_si128((const __m128i *)(rk + 16 * i)));
    _mm_storeu_si128((__m128i *)out, _mm_aesenclast_si128(m, _mm_loadu_si128((const __m128i *)(rk + 16 * 14))));
}

#endif

static void openssl_block(const unsigned char in[16], unsigned char out[16], const void *key) {
    AES_encrypt(in, out, &((const shaky_aes *)key)->fallback);
}

typedef struct {
    uint64_t run, round;
    uint32_t sender;
    int valid;
    shaky_aes aes;
    GCM128_CONTEXT *gcm;
} shaky_slot;

typedef struct {
    SHA256_CTX inner, outer;     /* HMAC-SHA256's pad states for the per-round keys */
    shaky_slot slot[SHAKY_KEY_SLOTS];
} shaky_mac;

size_t shaky_mac_size(void) { return sizeof(shaky_mac); }

/* key: 32 bytes. Returns 0, or -1 for another length. The contexts are made as rounds need them; shaky_mac_free
 * releases them. */
int shaky_mac_init(shaky_mac *m, const uint8_t *key, size_t n) {
    uint8_t pad[64];
    if (n != 32) return -1;
#ifdef SHAKY_X86
    if (have_aesni < 0) have_aesni = __builtin_cpu_supports("aes") && __builtin_cpu_supports("sse2");
#else
    have_aesni = 0;
#endif
    memset(m, 0, sizeof *m);
    memset(pad, 0, sizeof pad);
    memcpy(pad, key, n);
    for (int i = 0; i < 64; i++) pad[i] ^= 0x36;
    SHA256_Init(&m->inner);
    SHA256_Update(&m->inner, pad, 64);
    for (int i = 0; i < 64; i++) pad[i] ^= 0x36 ^ 0x5c;
    SHA256_Init(&m->outer);
    SHA256_Update(&m->outer, pad, 64);
    OPENSSL_cleanse(pad, sizeof pad);
    return 0;
}

void shaky_mac_free(shaky_mac *m) {
    for (int i = 0; i < SHAKY_KEY_SLOTS; i++)
        if (m->slot[i].gcm) CRYPTO_gcm128_release(m->slot[i].gcm);
    OPENSSL_cleanse(m, sizeof *m);
}

/* The GCM context keyed for (run, sender, round): cached, or derived into the slot it hashes to. */
static GCM128_CONTEXT *keyed(shaky_mac *m, uint64_t run, uint32_t sender, uint64_t round) {
    uint32_t h = (uint32_t)(sender * 0x9E3779B1u) ^ (uint32_t)(round * 0x85EBCA77u) ^ (uint32_t)(round >> 32)
                 ^ (uint32_t)run;
    shaky_slot *s = &m->slot[(h ^ (h >> 16)) % SHAKY_KEY_SLOTS];
    if (s->valid && s->run == run && s->sender == sender && s->round == round) return s->gcm;
    static const uint8_t label[15] = "shaky udp gmac";   /* 14 characters and its terminating 0 */
    uint8_t info[15 + 18], key[SHA256_DIGEST_LENGTH];
    uint16_t snd = (uint16_t)sender;
    memcpy(info, label, 15);
    memcpy(info + 15, &run, 8);
    memcpy(info + 23, &snd, 2);
    memcpy(info + 25, &round, 8);
    SHA256_CTX c = m->inner;
    SHA256_Update(&c, info, sizeof info);
    SHA256_Final(key, &c);
    c = m->outer;
    SHA256_Update(&c, key, sizeof key);
    SHA256_Final(key, &c);
    s->valid = 0;
    block128_f block = openssl_block;
#ifdef SHAKY_X86
    if (have_aesni == 1) {
        aesni_expand(key, s->aes.rk);
        block = aesni_block;
    } else
#endif
    if (AES_set_encrypt_key(key, 256, &s->aes.fallback) != 0) {
        OPENSSL_cleanse(key, sizeof key);
        return NULL;
    }
    OPENSSL_cleanse(key, sizeof key);
    if (s->gcm)
        CRYPTO_gcm128_init(s->gcm, &s->aes, block);
    else if (!(s->gcm = CRYPTO_gcm128_new(&s->aes, block)))
        return NULL;
    s->run = run, s->sender = sender, s->round = round, s->valid = 1;
    return s->gcm;
}

/* The tag of the `len` bytes at msg (a header and its payload). Returns 0, or -1 (tag all zeros: it never
 * verifies) for fewer bytes than a header or an OpenSSL failure. */
static int gmac(shaky_mac *m, const uint8_t *msg, size_t len, uint8_t *tag) {
    uint64_t run, round;
    uint16_t sender;
    uint8_t iv[12];
    memset(tag, 0, SHAKY_TAG_BYTES);
    if (len < SHAKY_HEADER_BYTES) return -1;
    memcpy(&sender, msg + 6, 2);
    memcpy(&run, msg + 8, 8);
    memcpy(&round, msg + 16, 8);
    GCM128_CONTEXT *c = keyed(m, run, sender, round);
    if (!c) return -1;
    iv[0] = msg[3];
    iv[1] = msg[5];
    memcpy(iv + 2, msg + 24, 4);
    memcpy(iv + 6, msg + 28, 4);
    iv[10] = iv[11] = 0;
    CRYPTO_gcm128_setiv(c, iv, sizeof iv);
    if (CRYPTO_gcm128_aad(c, msg, len) != 0) return -1;
    CRYPTO_gcm128_tag(c, tag, SHAKY_TAG_BYTES);
    return 0;
}

/* The tags of `count` messages: message i is `lengths[i]` bytes (or `length` when lengths is NULL) at
 * buf + i * stride; tag i goes to out + 16 i. */
void shaky_tags(shaky_mac *m, const uint8_t *buf, size_t stride, const uint32_t *lengths, size_t length,
                size_t count, uint8_t *out) {
    for (size_t i = 0; i < count; i++)
        gmac(m, buf + i * stride, lengths ? lengths[i] : length, out + i * SHAKY_TAG_BYTES);
}

/* A block's datagrams in one pass: row k of out (rows of `size` bytes) is header k (headers: 36 bytes a row), then
 * the block's bytes k * psize on (psize of them, or what is left for the last row), then its tag; `nrows` rows
 * for the `nbytes` at src. Each row's tag is computed while its bytes are still in the cache. */
void shaky_pack(shaky_mac *m, uint8_t *out, size_t size, const uint8_t *headers, const uint8_t *src, size_t nbytes,
                size_t psize, size_t nrows) {
    for (size_t k = 0; k < nrows; k++) {
        uint8_t *row = out + k * size;
        size_t n = nbytes - k * psize < psize ? nbytes - k * psize : psize;
        memcpy(row, headers + k * SHAKY_HEADER_BYTES, SHAKY_HEADER_BYTES);
        memcpy(row + SHAKY_HEADER_BYTES, src + k * psize, n);
        gmac(m, row, SHAKY_HEADER_BYTES + n, row + SHAKY_HEADER_BYTES + n);
    }
}

/* One round of one exchange as the receive path needs it (shaky/comm/udp/exchange.py's _Round fills it in;
 * ctypes.Structure _CRound mirrors it). Entry e = (phase - 1) * W * W + block * W + sender: where that
 * sender's segments of that block go in that phase (dest, 0: nowhere, i.e. anything of it is for Python's
 * rules), its arrival bytes (got, one per segment), its segments and its last segment's payload bytes. */
typedef struct {
    uint64_t run, round;
    uint32_t W, payload;                 /* ranks; payload bytes of a full segment */
    uint32_t dtype, open1, open2;        /* the round's dtype code; whether each phase is still open */
    const uint64_t *peer_keys;           /* [W] address << 16 | port of each rank (0: this one) */
    const uint64_t *dest, *got;          /* [2 W W] addresses (0: no target) */
    const uint32_t *nseg, *lastlen;      /* [2 W W] */
    uint32_t *count;                     /* [2 W] out: datagrams placed per (phase, sender) in this call */
    uint8_t *final, *last;               /* [2 W] out: one of them final / the stream's very last */
} shaky_round;

/* Whether datagram d (n bytes, from address key a) is one the round takes as it is: then placed, and counted. */
static int place(shaky_mac *m, const shaky_round *r, const uint8_t *d, size_t n, uint64_t a) {
    if (n < SHAKY_HEADER_BYTES + SHAKY_TAG_BYTES || d[0] != 'S' || d[1] != 'K' || d[2] != SHAKY_VERSION
        || (d[3] != 1 && d[3] != 2) || d[4] != r->dtype || (d[5] & ~1u) != 0) return 0;
    uint32_t phase = d[3];
    if (!(phase == 1 ? r->open1 : r->open2)) return 0;
    uint16_t sender; uint64_t hrun, hround; uint32_t block, k, len;
    memcpy(&sender, d + 6, 2); memcpy(&hrun, d + 8, 8); memcpy(&hround, d + 16, 8);
    memcpy(&block, d + 24, 4); memcpy(&k, d + 28, 4); memcpy(&len, d + 32, 4);
    uint32_t W = r->W;
    if (hrun != r->run || hround != r->round || sender >= W || block >= W || a == 0 || a != r->peer_keys[sender])
        return 0;
    size_t e = ((size_t)(phase - 1) * W + block) * W + sender;
    uint8_t *dest = (uint8_t *)(uintptr_t)r->dest[e];
    uint8_t *got = (uint8_t *)(uintptr_t)r->got[e];
    uint32_t nseg = r->nseg[e];
    if (!dest || k >= nseg || len != (k == nseg - 1 ? r->lastlen[e] : r->payload)
        || n != (size_t)len + SHAKY_HEADER_BYTES + SHAKY_TAG_BYTES || got[k]) return 0;
    uint8_t tag[SHAKY_TAG_BYTES];
    if (gmac(m, d, n - SHAKY_TAG_BYTES, tag) != 0 || CRYPTO_memcmp(tag, d + n - SHAKY_TAG_BYTES, SHAKY_TAG_BYTES))
        return 0;
    memcpy(dest + (size_t)k * r->payload, d + SHAKY_HEADER_BYTES, len);
    got[k] = 1;
    size_t ps = (size_t)(phase - 1) * W + sender;
    r->count[ps]++;
    if (d[5] & 1u) {
        r->final[ps] = 1;
        if (k == nseg - 1) r->last[ps] = 1;
    }
    return 1;
}

/* Receives what waits on the non-blocking socket `fd` (UDP_GRO on or off), without blocking: up to `max_msgs`
 * messages a recvmmsg into buf (stride `msg_stride` each), each cut into its datagrams (the kernel's gso_size
 * where it coalesced them). Every datagram the round `r` takes is placed and counted (r->count, final, last:
 * zeroed first); every other one is copied for Python's rules to rest (row i at rest + i * rest_stride, its
 * length in rest_len[i]: rest_stride + 1 where it was longer and cut, its address key in rest_addr[i]). Stops
 * when the socket is empty or rest might not hold another message's datagrams (per_msg: the most one message
 * may hold; the kernel coalesces at most 64). *n_rest: the rows of rest used.
 * Returns the datagrams placed, or -errno (rows in rest still count). */
long shaky_drain(int fd, shaky_mac *m, shaky_round *r, uint8_t *buf, size_t msg_stride, int max_msgs,
                 int per_msg, uint8_t *rest, size_t rest_stride, int rest_max, uint32_t *rest_len,
                 uint64_t *rest_addr, int *n_rest) {
    struct mmsghdr msgs[SHAKY_MAX_MSGS];
    struct iovec iov[SHAKY_MAX_MSGS];
    struct sockaddr_in from[SHAKY_MAX_MSGS];
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } ctl[SHAKY_MAX_MSGS];
    long placed = 0;
    int nr = 0;
    size_t W = r->W;
    memset(r->count, 0, 2 * W * sizeof *r->count);
    memset(r->final, 0, 2 * W);
    memset(r->last, 0, 2 * W);
    if (max_msgs > SHAKY_MAX_MSGS) max_msgs = SHAKY_MAX_MSGS;
    *n_rest = 0;
    for (;;) {
        int want = (rest_max - nr) / (per_msg > 0 ? per_msg : 1);
        if (want > max_msgs) want = max_msgs;
        if (want < 1) break;
        memset(msgs, 0, sizeof(struct mmsghdr) * (size_t)want);
        for (int i = 0; i < want; i++) {
            iov[i].iov_base = buf + (size_t)i * msg_stride;
            iov[i].iov_len = msg_stride;
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
            msgs[i].msg_hdr.msg_name = &from[i];
            msgs[i].msg_hdr.msg_namelen = sizeof from[i];
            msgs[i].msg_hdr.msg_control = ctl[i].buf;
            msgs[i].msg_hdr.msg_controllen = sizeof ctl[i].buf;
        }
        int got;
        do {
            got = recvmmsg(fd, msgs, (unsigned)want, MSG_DONTWAIT, NULL);
        } while (got < 0 && errno == EINTR);
        if (got < 0) {
            *n_rest = nr;
            return (errno == EAGAIN || errno == EWOULDBLOCK) ? placed : -errno;
        }
        for (int i = 0; i < got; i++) {
            struct msghdr *h = &msgs[i].msg_hdr;
            uint64_t a = 0;
            if (h->msg_namelen >= sizeof(struct sockaddr_in) && from[i].sin_family == AF_INET)
                a = ((uint64_t)ntohl(from[i].sin_addr.s_addr) << 16) | ntohs(from[i].sin_port);
            size_t total = msgs[i].msg_len, seg = 0;
            const uint8_t *base = buf + (size_t)i * msg_stride;
            if (h->msg_flags & MSG_TRUNC) {           /* longer than any datagram: one row, marked cut */
                size_t c = total < rest_stride ? total : rest_stride;
                memcpy(rest + (size_t)nr * rest_stride, base, c);
                rest_len[nr] = (uint32_t)rest_stride + 1;
                rest_addr[nr++] = a;
                continue;
            }
            for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c; c = CMSG_NXTHDR(h, c))
                if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO && c->cmsg_len >= CMSG_LEN(sizeof(int))) {
                    int g;
                    memcpy(&g, CMSG_DATA(c), sizeof g);
                    if (g > 0) seg = (size_t)g;
                }
            if (seg == 0 || seg >= total) seg = total ? total : 1;
            for (size_t o = 0; o < total || (total == 0 && o == 0); o += seg) {
                size_t n = total - o < seg ? total - o : seg;
                if (place(m, r, base + o, n, a)) {
                    placed++;
                } else if (nr < rest_max) {
                    size_t c = n <= rest_stride ? n : rest_stride;
                    memcpy(rest + (size_t)nr * rest_stride, base + o, c);
                    rest_len[nr] = n <= rest_stride ? (uint32_t)n : (uint32_t)rest_stride + 1;
                    rest_addr[nr++] = a;
                }
                if (total == 0) break;
            }
        }
        if (got < want) break;        /* the socket is empty */
    }
    *n_rest = nr;
    return placed;
}

/* Sends rows [first, first + count) of a packed block to ip:port (host order): rows of `size` bytes at buf + i *
 * size, row nrows - 1 only `last` bytes long. With segs > 1 each message carries up to `segs` rows as one UDP GSO
 * send (UDP_SEGMENT); up to `msgs` messages a sendmmsg, and no more than one sendmmsg a call. Returns the rows
 * the kernel took (fewer than count where its send buffer filled: send the rest later), or -errno when it took
 * none (-EAGAIN: the send buffer is full). */
long shaky_send(int fd, const uint8_t *buf, size_t size, size_t nrows, size_t last, size_t first, size_t count,
                uint32_t ip, uint32_t port, int segs, int msgs) {
    struct mmsghdr mm[SHAKY_MAX_MSGS];
    struct iovec iov[SHAKY_MAX_MSGS];
    union { char buf[CMSG_SPACE(sizeof(uint16_t))]; struct cmsghdr align; } ctl[SHAKY_MAX_MSGS];
    struct sockaddr_in to;
    size_t rows[SHAKY_MAX_MSGS];
    if (segs < 1) segs = 1;
    if (msgs > SHAKY_MAX_MSGS) msgs = SHAKY_MAX_MSGS;
    if (msgs < 1) msgs = 1;
    memset(&to, 0, sizeof to);
    to.sin_family = AF_INET;
    to.sin_addr.s_addr = htonl(ip);
    to.sin_port = htons((uint16_t)port);
    memset(mm, 0, sizeof mm);
    int n = 0;
    for (size_t k = first; k < first + count && n < msgs; n++) {
        size_t c = first + count - k < (size_t)segs ? first + count - k : (size_t)segs;
        size_t bytes = (c - 1) * size + (k + c == nrows ? last : size);
        iov[n].iov_base = (void *)(buf + k * size);
        iov[n].iov_len = bytes;
        mm[n].msg_hdr.msg_iov = &iov[n];
        mm[n].msg_hdr.msg_iovlen = 1;
        mm[n].msg_hdr.msg_name = &to;
        mm[n].msg_hdr.msg_namelen = sizeof to;
        if (c > 1) {
            uint16_t g = (uint16_t)size;
            mm[n].msg_hdr.msg_control = ctl[n].buf;
            mm[n].msg_hdr.msg_controllen = sizeof ctl[n].buf;
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mm[n].msg_hdr);
            cm->cmsg_level = SOL_UDP;
            cm->cmsg_type = UDP_SEGMENT;
            cm->cmsg_len = CMSG_LEN(sizeof g);
            memcpy(CMSG_DATA(cm), &g, sizeof g);
        }
        rows[n] = c;
        k += c;
    }
    int sent;
    do {
        sent = sendmmsg(fd, mm, (unsigned)n, MSG_DONTWAIT);
    } while (sent < 0 && errno == EINTR);
    if (sent < 0) return -errno;
    long total = 0;
    for (int i = 0; i < sent; i++) total += (long)rows[i];
    return total;
}

/* The simulator's block average (shaky/comm/sim.py) around its matrix products, which stay torch's.
 *
 * shaky_block_shares: out[j * w + i] (servers j, senders i; float32 or float64 by itemsize) = up[i * w + j] /
 * (the number of senders whose block reached server j): each arrival's weight in its server's average, what
 * torch computes as up_f / up_f.sum(0), transposed. The sums are counts (exact) and each division is correctly
 * rounded, so the bits are torch's. up: bool [sender, server], a byte each.
 *
 * shaky_take_averages, once every server's average is known: row k of out takes, block by block, the average
 * (avg: every block's average side by side, one row) where worker k received it (delivered[j * w + k] != 0:
 * the down mask, [server, worker]), else its own values x[k, block j]. block_bytes[j]: block j's size in bytes;
 * the strides are the byte distances between rows. Copies only, so the values are bit for bit those of the
 * torch path it stands in for; out may be x itself (a kept block is then left where it is). */
void shaky_block_shares(const uint8_t *up, int64_t w, void *out, int64_t itemsize) {
    for (int64_t j = 0; j < w; j++) {
        int64_t count = 0;
        for (int64_t i = 0; i < w; i++) count += up[i * w + j] != 0;
        for (int64_t i = 0; i < w; i++) {
            if (itemsize == 4)
                ((float *)out)[j * w + i] = (float)(up[i * w + j] != 0) / (float)count;
            else
                ((double *)out)[j * w + i] = (double)(up[i * w + j] != 0) / (double)count;
        }
    }
}

void shaky_take_averages(uint8_t *out, const uint8_t *x, const uint8_t *avg, const uint8_t *delivered,
                         const int64_t *block_bytes, int64_t w, int64_t out_stride, int64_t x_stride) {
    for (int64_t k = 0; k < w; k++) {
        uint8_t *dst = out + k * out_stride;
        const uint8_t *own = x + k * x_stride;
        const uint8_t *from = avg;
        for (int64_t j = 0; j < w; j++) {
            int64_t n = block_bytes[j];
            const uint8_t *src = delivered[j * w + k] ? from : own;
            if (n > 0 && src != dst) memcpy(dst, src, (size_t)n);
            dst += n;
            own += n;
            from += n;
        }
    }
}

/* numpy.random.default_rng(entropy).random(n) (float64), for the simulator's delivery masks (shaky.network.model),
 * which seed a fresh generator every round: numpy spends ~15 us a round building it in Python, this ~1 us.
 * The same numbers (tests/test_network.py draws both; shaky/native.py checks once at load and leaves this
 * unused if they ever differ): SeedSequence (O'Neill's seed_seq as numpy implements it: a pool of 4 words,
 * no spawn key) turns the entropy into the 256 bits that seed PCG64 (the 128-bit LCG with the XSL-RR output),
 * and each double is the top 53 bits of one output. The entropy is ``prefix`` (uint32 words) followed by each
 * of ``keys`` split into 32-bit words, least significant first (0 is one word), as numpy reads a list of ints.
 * Returns 0, or -1 (nothing written) for entropy of more than 64 words. */
#define SS_POOL 4
#define SS_INIT_A 0x43b0d7e5u
#define SS_MULT_A 0x931e8875u
#define SS_INIT_B 0x8b51f9ddu
#define SS_MULT_B 0x58f38dedu
#define SS_MIX_L 0xca01f9ddu
#define SS_MIX_R 0x4973f715u

static uint32_t ss_hashmix(uint32_t value, uint32_t *hash_const) {
    value ^= *hash_const;
    *hash_const *= SS_MULT_A;
    value *= *hash_const;
    return value ^ (value >> 16);
}

static uint32_t ss_mix(uint32_t x, uint32_t y) {
    uint32_t r = SS_MIX_L * x - SS_MIX_R * y;
    return r ^ (r >> 16);
}

typedef unsigned __int128 u128;
#define PCG_MULT (((u128)0x2360ED051FC65DA4ull << 64) | 0x4385DF649FCCF645ull)

int shaky_uniform(const uint32_t *prefix, int64_t n_prefix, const uint64_t *keys, int64_t n_keys,
                  double *out, int64_t n) {
    uint32_t entropy[64];
    int64_t len = 0;
    for (int64_t i = 0; i < n_prefix; i++) {
        if (len == 64) return -1;
        entropy[len++] = prefix[i];
    }
    for (int64_t k = 0; k < n_keys; k++) {
        uint64_t v = keys[k];
        do {
            if (len == 64) return -1;
            entropy[len++] = (uint32_t)v;
            v >>= 32;
        } while (v);
    }
    uint32_t pool[SS_POOL], hash_const = SS_INIT_A;
    for (int i = 0; i < SS_POOL; i++) pool[i] = ss_hashmix(i < len ? entropy[i] : 0u, &hash_const);
    for (int src = 0; src < SS_POOL; src++)
        for (int dst = 0; dst < SS_POOL; dst++)
            if (src != dst) pool[dst] = ss_mix(pool[dst], ss_hashmix(pool[src], &hash_const));
    for (int64_t src = SS_POOL; src < len; src++)
        for (int dst = 0; dst < SS_POOL; dst++) pool[dst] = ss_mix(pool[dst], ss_hashmix(entropy[src], &hash_const));
    /* generate_state(4, uint64): 8 words from the pool in turn, paired little-endian into 4 uint64. */
    uint32_t words[8];
    uint32_t hc = SS_INIT_B;
    for (int i = 0; i < 8; i++) {
        uint32_t v = pool[i % SS_POOL] ^ hc;
        hc *= SS_MULT_B;
        v *= hc;
        words[i] = v ^ (v >> 16);
    }
    uint64_t s64[4];
    for (int i = 0; i < 4; i++) s64[i] = (uint64_t)words[2 * i] | ((uint64_t)words[2 * i + 1] << 32);
    /* PCG64's seeding: state = (s64[0] << 64) + s64[1], stream = (s64[2] << 64) + s64[3]. */
    u128 initstate = ((u128)s64[0] << 64) | s64[1];
    u128 inc = ((((u128)s64[2] << 64) | s64[3]) << 1) | 1u;
    u128 state = 0;
    state = state * PCG_MULT + inc;
    state += initstate;
    state = state * PCG_MULT + inc;
    for (int64_t i = 0; i < n; i++) {
        state = state * PCG_MULT + inc;
        uint64_t xored = (uint64_t)(state >> 64) ^ (uint64_t)state;
        unsigned rot = (unsigned)(state >> 122);
        uint64_t r = (xored >> rot) | (xored << ((64 - rot) & 63));
        out[i] = (double)(r >> 11) * (1.0 / 9007199254740992.0);
    }
    return 0;
}

/* shaky.sampler.BatchSampler's indices for ``count`` steps from ``first``, the numbers of its numpy path
 * (tests/test_train.py compares both): out [count, w, width] (int64); worker k's slot b of step s holds, for b
 * below batch[k], its shard's sample (padded[k * padded_stride + ...]) at the position where the keyed
 * permutation of epoch e sends offset t % lengths[k] (t = s * batch[k] + b, e = t / lengths[k]); 0 beyond. The
 * permutation: four rounds of (xor key, multiply by an odd key, xor-shift by half the width) on the smallest
 * power-of-two range holding n, walked again while the image is n or more, then a keyed rotation. */
static uint64_t sm_mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

void shaky_batch_indices(int64_t *out, int64_t first, int64_t count, int64_t w, int64_t width,
                         const int64_t *batch, const int64_t *lengths, const uint64_t *worker_keys,
                         const int64_t *padded, int64_t padded_stride) {
    for (int64_t k = 0; k < w; k++) {
        uint64_t n = (uint64_t)lengths[k];
        unsigned bits = 1;
        while (bits < 64 && ((uint64_t)1 << bits) < n) bits++;
        uint64_t mask = bits == 64 ? ~(uint64_t)0 : ((uint64_t)1 << bits) - 1;
        unsigned half = (bits + 1) / 2;
        int64_t epoch = -1;
        uint64_t rk[4], mult[4], rotation = 0;
        for (int64_t s = 0; s < count; s++) {
            int64_t *row = out + (s * w + k) * width;
            for (int64_t b = 0; b < width; b++) {
                if (b >= batch[k]) {
                    row[b] = 0;
                    continue;
                }
                int64_t t = (first + s) * batch[k] + b;
                int64_t e = t / lengths[k];
                if (e != epoch) {
                    epoch = e;
                    uint64_t key = sm_mix(worker_keys[k] + (uint64_t)e);
                    for (int r = 0; r < 4; r++) {
                        rk[r] = sm_mix(key + (uint64_t)(r + 1));
                        mult[r] = rk[r] | 1u;
                    }
                    rotation = sm_mix(key) % n;
                }
                uint64_t y = (uint64_t)(t % lengths[k]);
                do {
                    for (int r = 0; r < 4; r++) {
                        y = (y ^ rk[r]) & mask;
                        y = (y * mult[r]) & mask;
                        y ^= y >> half;
                    }
                } while (y >= n);
                row[b] = padded[k * padded_stride + (int64_t)((y + rotation) % n)];
            }
        }
    }
}
