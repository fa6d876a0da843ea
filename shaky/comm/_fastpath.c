/* The UDP data plane's per-datagram work in C, called through ctypes by shaky/comm/udp.py (which falls back
 * to Python where this library was not built): tags for many datagrams in one call, and many datagrams
 * received in one system call (recvmmsg). ctypes releases the GIL for the length of each call.
 *
 * The tag is HMAC-SHA256 (RFC 2104) truncated to 16 bytes, computed from the key's inner and outer pad
 * states, hashed once: the same bytes as hmac.digest(key, msg, "sha256")[:16] (tests/test_udp.py checks it).
 */
#define _GNU_SOURCE
#define OPENSSL_SUPPRESS_DEPRECATED
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#define SHAKY_TAG_BYTES 16
#define SHAKY_MAX_BATCH 64

typedef struct {
    SHA256_CTX inner, outer;
} shaky_mac;

size_t shaky_mac_size(void) { return sizeof(shaky_mac); }

/* key: at most 64 bytes (udp.py hashes longer keys to 32 first). Returns 0, or -1 for a longer key. */
int shaky_mac_init(shaky_mac *m, const uint8_t *key, size_t n) {
    uint8_t pad[64];
    if (n > 64) return -1;
    memset(pad, 0, sizeof pad);
    memcpy(pad, key, n);
    for (int i = 0; i < 64; i++) pad[i] ^= 0x36;
    SHA256_Init(&m->inner);
    SHA256_Update(&m->inner, pad, 64);
    for (int i = 0; i < 64; i++) pad[i] ^= 0x36 ^ 0x5c;
    SHA256_Init(&m->outer);
    SHA256_Update(&m->outer, pad, 64);
    memset(pad, 0, sizeof pad);
    return 0;
}

/* The tags of `count` messages: message i is `lengths[i]` bytes (or `length` when lengths is NULL) at
 * buf + i * stride; tag i goes to out + 16 i. */
void shaky_tags(const shaky_mac *m, const uint8_t *buf, size_t stride, const uint32_t *lengths, size_t length,
                size_t count, uint8_t *out) {
    uint8_t digest[SHA256_DIGEST_LENGTH];
    for (size_t i = 0; i < count; i++) {
        SHA256_CTX c = m->inner;
        SHA256_Update(&c, buf + i * stride, lengths ? lengths[i] : length);
        SHA256_Final(digest, &c);
        c = m->outer;
        SHA256_Update(&c, digest, sizeof digest);
        SHA256_Final(digest, &c);
        memcpy(out + i * SHAKY_TAG_BYTES, digest, SHAKY_TAG_BYTES);
    }
}

/* Up to `max` (at most 64) datagrams waiting on the non-blocking socket `fd`, without blocking: datagram i
 * into buf + i * stride, lengths[i] its length (stride + 1 where it was longer than stride and cut), addrs[i]
 * its IPv4 source as address << 16 | port (host order; 0 for another family). Returns how many (0: none
 * waiting) or -errno. */
int shaky_recv(int fd, uint8_t *buf, size_t stride, int max, uint32_t *lengths, uint64_t *addrs) {
    struct mmsghdr msgs[SHAKY_MAX_BATCH];
    struct iovec iov[SHAKY_MAX_BATCH];
    struct sockaddr_in from[SHAKY_MAX_BATCH];
    if (max > SHAKY_MAX_BATCH) max = SHAKY_MAX_BATCH;
    if (max < 1) return 0;
    memset(msgs, 0, sizeof(struct mmsghdr) * (size_t)max);
    for (int i = 0; i < max; i++) {
        iov[i].iov_base = buf + (size_t)i * stride;
        iov[i].iov_len = stride;
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
        msgs[i].msg_hdr.msg_name = &from[i];
        msgs[i].msg_hdr.msg_namelen = sizeof from[i];
    }
    int n;
    do {
        n = recvmmsg(fd, msgs, (unsigned)max, MSG_DONTWAIT, NULL);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -errno;
    for (int i = 0; i < n; i++) {
        lengths[i] = (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) ? (uint32_t)stride + 1 : msgs[i].msg_len;
        if (msgs[i].msg_hdr.msg_namelen >= sizeof(struct sockaddr_in) && from[i].sin_family == AF_INET)
            addrs[i] = ((uint64_t)ntohl(from[i].sin_addr.s_addr) << 16) | ntohs(from[i].sin_port);
        else
            addrs[i] = 0;
    }
    return n;
}

/* Which datagrams of a receive batch take the fast path: full-size, this run's and round's, from the address of
 * the sender their header names, of the round's dtype and payload, flags 0 or final, phase 1 or 2, and a tag
 * that verifies. For each row: ok[i] (1 or 0), and for ok rows group[i] = (phase * W + block) * W + sender,
 * seg[i] the segment index, final[i] the final flag. Returns the number of ok rows. */
int shaky_check(const shaky_mac *m, const uint8_t *rows, size_t stride, const uint32_t *lengths,
                const uint64_t *addrs, int n, uint32_t size, uint64_t run, uint64_t round, uint8_t dtype,
                uint32_t payload, const uint64_t *peer_keys, uint32_t W, uint8_t *ok, uint32_t *group,
                uint32_t *seg, uint8_t *final) {
    int count = 0;
    uint8_t tag[SHAKY_TAG_BYTES];
    for (int i = 0; i < n; i++) {
        const uint8_t *r = rows + (size_t)i * stride;
        ok[i] = 0;
        if (lengths[i] != size || r[0] != 'S' || r[1] != 'K' || r[2] != 1 || (r[3] != 1 && r[3] != 2)
            || r[4] != dtype || (r[5] & ~1u) != 0) continue;
        uint16_t sender; uint64_t hrun, hround; uint32_t block, k, len;
        memcpy(&sender, r + 6, 2); memcpy(&hrun, r + 8, 8); memcpy(&hround, r + 16, 8);
        memcpy(&block, r + 24, 4); memcpy(&k, r + 28, 4); memcpy(&len, r + 32, 4);
        if (hrun != run || hround != round || len != payload || sender >= W || block >= W
            || addrs[i] == 0 || addrs[i] != peer_keys[sender]) continue;
        shaky_tags(m, r, 0, NULL, size - SHAKY_TAG_BYTES, 1, tag);
        if (CRYPTO_memcmp(tag, r + size - SHAKY_TAG_BYTES, SHAKY_TAG_BYTES) != 0) continue;
        ok[i] = 1;
        group[i] = ((uint32_t)r[3] * W + block) * W + sender;
        seg[i] = k;
        final[i] = r[5] & 1u;
        count++;
    }
    return count;
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
