/* The cost of a datagram's tag, in C: the candidates OpenSSL's libcrypto offers, against the one shaky uses.
 *
 *     gcc -O2 -o /tmp/tag_cost benchmarks/tag_cost.c -lcrypto && /tmp/tag_cost
 *
 * Microseconds (and GB/s) per message of 1456, 8956 and 65491 bytes: the header and payload of a datagram of
 * 1472 bytes (a 1500-byte MTU), 8992 (a 9000-byte jumbo frame) and 65507 (the most one UDP datagram holds, what
 * loopback's 64 KiB MTU allows). Each the fastest of 15 runs of 20,000 messages, one core:
 *
 *   hmac-sha256          HMAC-SHA256 with the pads' states hashed once (wire version 1's tag)
 *   evp aes-256-gcm      GMAC through EVP: the IV set a message, the message as AAD, the tag (EVP's own calls)
 *   evp chacha20-poly1305  the same with ChaCha20-Poly1305 (its Poly1305 key derived per message)
 *   evp_mac poly1305     EVP_MAC "POLY1305" with a one-time key derived per message by ChaCha20 (EVP)
 *   shaky gmac           shaky/comm/_fastpath.c's tag: AES-256-GMAC, OpenSSL's CRYPTO_gcm128 GHASH with an AES-NI
 *                        block function (one block a message), the key cached per sender and round
 *   memcpy               copying the message once, for scale
 */
#define OPENSSL_SUPPRESS_DEPRECATED
#include "../shaky/comm/_fastpath.c"
#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <stdio.h>
#include <time.h>

#define N 20000
#define REPEATS 15
static uint8_t buf[2 * 65536 + 64], key[32] = {1, 2, 3};
static size_t len;
static volatile uint8_t sink;
static SHA256_CTX in_pad, out_pad;
static EVP_CIPHER_CTX *gcm, *chapoly, *chacha;
static EVP_MAC_CTX *poly;
static shaky_mac mac;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void hmac_sha256(int n) {
    uint8_t tag[32];
    for (int i = 0; i < n; i++) {
        SHA256_CTX c = in_pad;
        SHA256_Update(&c, buf, len);
        SHA256_Final(tag, &c);
        c = out_pad;
        SHA256_Update(&c, tag, 32);
        SHA256_Final(tag, &c);
        sink ^= tag[0];
    }
}

static void evp_aead(EVP_CIPHER_CTX *c, int get_tag, int n) {
    uint8_t tag[16], iv[12] = {0};
    int ol;
    for (int i = 0; i < n; i++) {
        memcpy(iv, &i, 4);
        EVP_EncryptInit_ex(c, NULL, NULL, NULL, iv);
        EVP_EncryptUpdate(c, NULL, &ol, buf, (int)len);
        EVP_EncryptFinal_ex(c, tag, &ol);
        EVP_CIPHER_CTX_ctrl(c, get_tag, 16, tag);
        sink ^= tag[0];
    }
}
static void evp_gcm(int n) { evp_aead(gcm, EVP_CTRL_GCM_GET_TAG, n); }
static void evp_chapoly(int n) { evp_aead(chapoly, EVP_CTRL_AEAD_GET_TAG, n); }

static void evp_poly1305(int n) {
    uint8_t zeros[32] = {0}, one_time[32], iv[16] = {0}, tag[16];
    int ol;
    size_t tl;
    for (int i = 0; i < n; i++) {
        memcpy(iv + 4, &i, 4);
        EVP_EncryptInit_ex(chacha, NULL, NULL, key, iv);
        EVP_EncryptUpdate(chacha, one_time, &ol, zeros, 32);
        EVP_MAC_init(poly, one_time, 32, NULL);
        EVP_MAC_update(poly, buf, len);
        EVP_MAC_final(poly, tag, &tl, 16);
        sink ^= tag[0];
    }
}

static void shaky_gmac(int n) {
    uint8_t tag[16];
    for (int i = 0; i < n; i++) {
        memcpy(buf + 28, &i, 4);        /* the segment index: a nonce of its own each time */
        gmac(&mac, buf, len, tag);
        sink ^= tag[0];
    }
}

static void copy(int n) {
    for (int i = 0; i < n; i++) {
        memcpy(buf + 65536 + 64, buf, len);
        sink ^= buf[65536 + 64 + i % len];
    }
}

static void run(const char *name, void (*f)(int)) {
    double best = 1e9;
    for (int r = 0; r < REPEATS; r++) {
        double t = now();
        f(N);
        t = now() - t;
        if (t < best) best = t;
    }
    printf("  %-22s %6zu B: %7.3f us  %5.2f GB/s\n", name, len, best / N * 1e6, len / (best / N) / 1e9);
}

int main(void) {
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)(i * 7);
    memcpy(buf, "SK\x02\x01\x02\x00", 6);
    uint8_t pad[64] = {0};
    memcpy(pad, key, 32);
    for (int i = 0; i < 64; i++) pad[i] ^= 0x36;
    SHA256_Init(&in_pad);
    SHA256_Update(&in_pad, pad, 64);
    for (int i = 0; i < 64; i++) pad[i] ^= 0x36 ^ 0x5c;
    SHA256_Init(&out_pad);
    SHA256_Update(&out_pad, pad, 64);
    gcm = EVP_CIPHER_CTX_new();
    EVP_EncryptInit_ex(gcm, EVP_aes_256_gcm(), NULL, key, NULL);
    chapoly = EVP_CIPHER_CTX_new();
    EVP_EncryptInit_ex(chapoly, EVP_chacha20_poly1305(), NULL, key, NULL);
    chacha = EVP_CIPHER_CTX_new();
    EVP_EncryptInit_ex(chacha, EVP_chacha20(), NULL, key, NULL);
    EVP_MAC *m = EVP_MAC_fetch(NULL, "POLY1305", NULL);
    poly = EVP_MAC_CTX_new(m);
    shaky_mac_init(&mac, key, 32);
    size_t sizes[] = {1456, 8956, 65491};
    for (int s = 0; s < 3; s++) {
        len = sizes[s];
        printf("%zu-byte messages (a %zu-byte datagram less its tag):\n", len, len + 16);
        run("hmac-sha256", hmac_sha256);
        run("evp aes-256-gcm", evp_gcm);
        run("evp chacha20-poly1305", evp_chapoly);
        run("evp_mac poly1305", evp_poly1305);
        run("shaky gmac", shaky_gmac);
        run("memcpy", copy);
    }
    return sink == 255;
}
