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

/* The end of the simulator's block average (shaky/comm/sim.py), once every server's average is known: row k of
 * out takes, block by block, the average (avg: every block's average side by side, one row) where worker k
 * received it (lost[k * w + j] == 0), else its own values x[k, block j]. block_bytes[j]: block j's size in
 * bytes; the strides are the byte distances between rows. Copies only, so the values are bit for bit those of
 * the torch path it stands in for; out may be x itself (a kept block is then left where it is). */
void shaky_take_blocks(uint8_t *out, const uint8_t *x, const uint8_t *avg, const uint8_t *lost,
                       const int64_t *block_bytes, int64_t w, int64_t out_stride, int64_t x_stride) {
    for (int64_t k = 0; k < w; k++) {
        uint8_t *dst = out + k * out_stride;
        const uint8_t *own = x + k * x_stride;
        const uint8_t *from = avg;
        for (int64_t j = 0; j < w; j++) {
            int64_t n = block_bytes[j];
            const uint8_t *src = lost[k * w + j] ? own : from;
            if (n > 0 && src != dst) memcpy(dst, src, (size_t)n);
            dst += n;
            own += n;
            from += n;
        }
    }
}
