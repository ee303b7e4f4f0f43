/*
 * cachetree._speedups: the compiled twin of the ingest hot spots (optional).
 *
 * Rules of this file: every function here has a pure-Python twin that defines its result
 * (cachetree/keys.py, router/events.py); this file only computes the same thing without a
 * Python object per token. The tests run against both and hold them bit-exact. Nothing here
 * keeps state between calls. Which path is active is decided in cachetree/accel.py.
 *
 * Theory of operation
 * -------------------
 * Profiles of a replica ingesting full-cache churn put the per-token work first: msgspec made
 * one Python int per token id, `array("I", ...)` packed them again, and each block's key was
 * one Python-level xxh3 call over a sliced copy. Here:
 *
 * - `parse_tokens(raw, cap, pairs)` reads the msgpack array of token ids (flat ints, or with
 *   `pairs` SGLang's bigram pairs, first element kept) straight into packed u32 little-endian
 *   bytes, refusing exactly what the decoder's typed path refuses (a non-int, a bool, a
 *   negative id, one >= 2**32, the other shape, a pair that is not two ints, more than `cap`).
 *   The caller falls back to the reference decoder on any refusal, which names the error.
 * - `block_keys(token_ids, block_size, seed)` chains XXH3-64 over the blocks of a list of
 *   ints or of a u32 array, as cachetree/keys.py does: key[i] = xxh3_64(block i, seed=key[i-1]).
 * - The tree's runs and tables are in cachetree/_tables.c.
 * - `normalize_events` is the decoder's loop from typed events to normalized ones
 *   (router/events.py `_normalize_events_py`): the one-block removals an evicting engine sends
 *   dozens of per batch are built here; every other event calls its own `normalize()`.
 * - `decode_map_batch` takes a whole batch of tagged-map events (what vLLM >= 0.24 and
 *   SGLang >= 0.5.20 send): the root, ts and dp_rank are read here, and the two events a busy
 *   engine sends are built without any intermediate object: a one-block BlockRemoved of the
 *   usual shape, and a BlockStored of the usual shape (flat token ids read once, straight into
 *   the packed u32 array, hashes to u64). Every other event's bytes (and its index) are
 *   handed to the Python decoder of single events, which decides what it is (ignored, bigram
 *   pairs, salted, an error, which it names and which ends the batch here). Anything else
 *   about the batch (positional events, extra root elements, odd encodings) returns None, and
 *   the Python decoders take the whole batch: they alone name errors. The twin of both is the
 *   typed path of router/events.py; the tests hold them to the generic reference decoder,
 *   shape by shape and under mutation.
 * - XXH3-64 is written from its published specification (xxHash's doc/xxhash_spec.md, "XXH3
 *   algorithm description"), every length class including the seeded long-input path, and
 *   tested bit-exact against the `xxhash` package. Engines' block sizes put a block in the
 *   17-128 byte class (16 tokens = 64 bytes), which is a handful of 64x64->128 multiplies.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

/* Token ids are hashed as native u32 arrays, which the key scheme defines as little-endian
 * (cachetree/keys.py refuses other hosts too). The build is optional: failing here leaves the
 * pure-Python path. */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "cachetree._speedups needs a little-endian host (gcc or clang)"
#endif

/* ---- XXH3-64 (from the specification) --------------------------------------------------- */

#define PRIME32_1 0x9E3779B1U
#define PRIME32_2 0x85EBCA77U
#define PRIME32_3 0xC2B2AE3DU
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL
#define PRIME_MX1 0x165667919E3779F9ULL
#define PRIME_MX2 0x9FB21C651E98DF25ULL

#define SECRET_SIZE 192
#define STRIPE_LEN 64
#define STRIPES_PER_BLOCK ((SECRET_SIZE - STRIPE_LEN) / 8)
#define BLOCK_LEN (STRIPE_LEN * STRIPES_PER_BLOCK)

/* The specification's default secret. */
static const uint8_t default_secret[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* Little-endian loads (the spec reads everything LE; the host is LE, checked above). */
static inline uint32_t
read32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t
read64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline void
write64(uint8_t *p, uint64_t v)
{
    memcpy(p, &v, 8);
}

static inline uint32_t
swap32(uint32_t x)
{
    return (x >> 24) | ((x >> 8) & 0xff00U) | ((x << 8) & 0xff0000U) | (x << 24);
}

static inline uint64_t
swap64(uint64_t x)
{
    return (uint64_t)swap32((uint32_t)x) << 32 | swap32((uint32_t)(x >> 32));
}

static inline uint64_t
rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

/* The low and high halves of the 128-bit product, xored together. */
static inline uint64_t
mul128_fold64(uint64_t a, uint64_t b)
{
#if defined(__SIZEOF_INT128__)
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
#else
    uint64_t lo_lo = (a & 0xFFFFFFFFULL) * (b & 0xFFFFFFFFULL);
    uint64_t hi_lo = (a >> 32) * (b & 0xFFFFFFFFULL);
    uint64_t lo_hi = (a & 0xFFFFFFFFULL) * (b >> 32);
    uint64_t hi_hi = (a >> 32) * (b >> 32);
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    uint64_t lower = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
    return lower ^ upper;
#endif
}

static inline uint64_t
avalanche(uint64_t x)
{
    x ^= x >> 37;
    x *= PRIME_MX1;
    return x ^ (x >> 32);
}

static inline uint64_t
avalanche_xxh64(uint64_t x)
{
    x ^= x >> 33;
    x *= PRIME64_2;
    x ^= x >> 29;
    x *= PRIME64_3;
    return x ^ (x >> 32);
}

static inline uint64_t
mix_step(const uint8_t *data, const uint8_t *secret, uint64_t seed)
{
    return mul128_fold64(read64(data) ^ (read64(secret) + seed),
                         read64(data + 8) ^ (read64(secret + 8) - seed));
}

static uint64_t
xxh3_0to16(const uint8_t *in, size_t len, uint64_t seed)
{
    const uint8_t *s = default_secret;
    if (len > 8) {
        uint64_t lo = ((read64(s + 24) ^ read64(s + 32)) + seed) ^ read64(in);
        uint64_t hi = ((read64(s + 40) ^ read64(s + 48)) - seed) ^ read64(in + len - 8);
        return avalanche(len + swap64(lo) + hi + mul128_fold64(lo, hi));
    }
    if (len >= 4) {
        uint64_t modified = seed ^ (uint64_t)swap32((uint32_t)seed) << 32;
        uint64_t combined = (uint64_t)read32(in + len - 4) | (uint64_t)read32(in) << 32;
        uint64_t v = ((read64(s + 8) ^ read64(s + 16)) - modified) ^ combined;
        v ^= rotl64(v, 49) ^ rotl64(v, 24);
        v *= PRIME_MX2;
        v ^= (v >> 35) + len;
        v *= PRIME_MX2;
        return v ^ (v >> 28);
    }
    if (len > 0) {
        uint32_t combined = (uint32_t)in[len - 1] | (uint32_t)len << 8 | (uint32_t)in[0] << 16
                            | (uint32_t)in[len >> 1] << 24;
        return avalanche_xxh64(((uint64_t)(read32(s) ^ read32(s + 4)) + seed) ^ combined);
    }
    return avalanche_xxh64(seed ^ read64(s + 56) ^ read64(s + 64));
}

static uint64_t
xxh3_17to128(const uint8_t *in, size_t len, uint64_t seed)
{
    const uint8_t *s = default_secret;
    uint64_t acc = len * PRIME64_1;
    for (Py_ssize_t i = (Py_ssize_t)((len - 1) >> 5); i >= 0; i--) {
        acc += mix_step(in + 16 * i, s + 32 * i, seed);
        acc += mix_step(in + len - 16 - 16 * i, s + 32 * i + 16, seed);
    }
    return avalanche(acc);
}

static uint64_t
xxh3_129to240(const uint8_t *in, size_t len, uint64_t seed)
{
    const uint8_t *s = default_secret;
    uint64_t acc = len * PRIME64_1;
    size_t chunks = len >> 4;
    for (size_t i = 0; i < 8; i++) {
        acc += mix_step(in + 16 * i, s + 16 * i, seed);
    }
    acc = avalanche(acc);
    for (size_t i = 8; i < chunks; i++) {
        acc += mix_step(in + 16 * i, s + 16 * (i - 8) + 3, seed);
    }
    acc += mix_step(in + len - 16, s + 119, seed);
    return avalanche(acc);
}

static inline void
accumulate(uint64_t *acc, const uint8_t *stripe, const uint8_t *secret)
{
    for (int i = 0; i < 8; i++) {
        uint64_t value = read64(stripe + 8 * i);
        uint64_t keyed = value ^ read64(secret + 8 * i);
        acc[i ^ 1] += value;
        acc[i] += (keyed & 0xFFFFFFFFULL) * (keyed >> 32);
    }
}

static uint64_t
xxh3_long(const uint8_t *in, size_t len, uint64_t seed)
{
    uint8_t derived[SECRET_SIZE];
    const uint8_t *s = default_secret;
    if (seed) {
        for (int i = 0; i < SECRET_SIZE / 16; i++) {
            write64(derived + 16 * i, read64(default_secret + 16 * i) + seed);
            write64(derived + 16 * i + 8, read64(default_secret + 16 * i + 8) - seed);
        }
        s = derived;
    }
    uint64_t acc[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3,
                       PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
    size_t blocks = (len - 1) / BLOCK_LEN;
    for (size_t b = 0; b < blocks; b++) {
        const uint8_t *block = in + b * BLOCK_LEN;
        for (int n = 0; n < STRIPES_PER_BLOCK; n++) {
            accumulate(acc, block + n * STRIPE_LEN, s + 8 * n);
        }
        for (int i = 0; i < 8; i++) {
            acc[i] ^= acc[i] >> 47;
            acc[i] ^= read64(s + SECRET_SIZE - STRIPE_LEN + 8 * i);
            acc[i] *= PRIME32_1;
        }
    }
    const uint8_t *last = in + blocks * BLOCK_LEN;
    size_t stripes = (len - 1 - blocks * BLOCK_LEN) / STRIPE_LEN;
    for (size_t n = 0; n < stripes; n++) {
        accumulate(acc, last + n * STRIPE_LEN, s + 8 * n);
    }
    accumulate(acc, in + len - STRIPE_LEN, s + SECRET_SIZE - STRIPE_LEN - 7);
    uint64_t result = len * PRIME64_1;
    for (int i = 0; i < 4; i++) {
        result += mul128_fold64(acc[2 * i] ^ read64(s + 11 + 16 * i),
                                acc[2 * i + 1] ^ read64(s + 11 + 16 * i + 8));
    }
    return avalanche(result);
}

static uint64_t
xxh3_64(const uint8_t *in, size_t len, uint64_t seed)
{
    if (len <= 16) {
        return xxh3_0to16(in, len, seed);
    }
    if (len <= 128) {
        return xxh3_17to128(in, len, seed);
    }
    if (len <= 240) {
        return xxh3_129to240(in, len, seed);
    }
    return xxh3_long(in, len, seed);
}

/* ---- Python entry points ---------------------------------------------------------------- */

static PyObject *
py_xxh3_64(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "xxh3_64(data, seed) takes 2 arguments");
        return NULL;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[1]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    uint64_t h = xxh3_64((const uint8_t *)view.buf, (size_t)view.len, seed);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

/* Chained keys over `nblocks` blocks of `block_bytes` bytes each. */
static PyObject *
chain(const uint8_t *data, Py_ssize_t nblocks, Py_ssize_t block_bytes, uint64_t seed)
{
    PyObject *keys = PyList_New(nblocks);
    if (keys == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        seed = xxh3_64(data + i * block_bytes, (size_t)block_bytes, seed);
        PyObject *key = PyLong_FromUnsignedLongLong(seed);
        if (key == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
        PyList_SET_ITEM(keys, i, key);
    }
    return keys;
}

/* One token as u32, with array("I")'s rules: an int (or __index__) in [0, 2**32). */
static int
token_u32(PyObject *item, uint32_t *out)
{
    unsigned long value;
    /* A token id is a small int: read its one digit, without PyLong_AsUnsignedLong's checks
       (half of a 2,000-token prompt's keying went there). Negatives and wide ints fall
       through to the checked read, which raises as array("I") does. */
#if PY_VERSION_HEX >= 0x030C0000
    if (PyLong_CheckExact(item) && PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        Py_ssize_t compact = PyUnstable_Long_CompactValue((PyLongObject *)item);
        if (compact >= 0 && (unsigned long long)compact <= 0xFFFFFFFFULL) {
            *out = (uint32_t)compact;
            return 0;
        }
    }
#else
    if (PyLong_CheckExact(item) && (Py_SIZE(item) == 0 || Py_SIZE(item) == 1)) {
        *out = Py_SIZE(item) ? (uint32_t)((PyLongObject *)item)->ob_digit[0] : 0;
        return 0;
    }
#endif
    if (PyLong_Check(item)) {
        value = PyLong_AsUnsignedLong(item);
    }
    else {
        PyObject *index = PyNumber_Index(item);
        if (index == NULL) {
            return -1;
        }
        value = PyLong_AsUnsignedLong(index);
        Py_DECREF(index);
    }
    if (value == (unsigned long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (value > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_OverflowError, "unsigned int is greater than maximum");
        return -1;
    }
    *out = (uint32_t)value;
    return 0;
}

static int
is_u32_buffer(const Py_buffer *view)
{
    return view->itemsize == 4 && view->format != NULL && view->format[0] == 'I'
           && view->format[1] == '\0';
}

/* bytes, bytearray, array("B"): one token id per byte (the `bytes` tokenizer's ids). */
static int
is_u8_buffer(const Py_buffer *view)
{
    return view->itemsize == 1 && view->format != NULL && view->format[0] == 'B'
           && view->format[1] == '\0';
}

static PyObject *
py_block_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "block_keys(token_ids, block_size, seed) takes 3 arguments");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[2]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *tokens = args[0];
    /* Ids one a byte (`view`) or a sequence of ints (`seq`) are packed as u32 below; a u32
     * buffer is chained as it is. */
    Py_buffer view;
    const uint8_t *bytes = NULL;
    PyObject *seq = NULL;
    Py_ssize_t n;
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens) && PyObject_CheckBuffer(tokens)) {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
            if (is_u32_buffer(&view)) {
                PyObject *keys = NULL;
                if (block_size <= 0) {
                    PyErr_SetString(PyExc_ValueError, "block size must be positive");
                }
                else {
                    n = view.len / 4;
                    keys = chain((const uint8_t *)view.buf, n / block_size, block_size * 4, seed);
                }
                PyBuffer_Release(&view);
                return keys;
            }
            if (is_u8_buffer(&view)) {
                bytes = (const uint8_t *)view.buf;
            }
            else {
                PyBuffer_Release(&view);
            }
        }
        else {
            PyErr_Clear(); /* not a contiguous typed buffer: read it as a sequence below */
        }
    }
    PyObject **items = NULL;
    if (bytes != NULL) {
        n = view.len;
    }
    else {
        seq = PySequence_Fast(tokens, "token_ids must be a sequence of ints");
        if (seq == NULL) {
            return NULL;
        }
        n = PySequence_Fast_GET_SIZE(seq);
        items = PySequence_Fast_ITEMS(seq);
    }
    uint32_t stack[4096];
    uint32_t *packed = n <= 4096 ? stack : PyMem_Malloc((size_t)n * 4);
    PyObject *keys = NULL;
    if (packed == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (bytes != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            packed[i] = bytes[i];
        }
    }
    else {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (token_u32(items[i], &packed[i]) < 0) {
                goto done;
            }
        }
    }
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block size must be positive");
        goto done;
    }
    keys = chain((const uint8_t *)packed, n / block_size, block_size * 4, seed);
done:
    if (packed != stack) {
        PyMem_Free(packed); /* PyMem_Free(NULL) is a no-op */
    }
    if (bytes != NULL) {
        PyBuffer_Release(&view);
    }
    Py_XDECREF(seq);
    return keys;
}

/* ---- msgpack token ids -> packed u32 ---------------------------------------------------- */

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Reader;

static inline int
need(const Reader *r, size_t n)
{
    return (size_t)(r->end - r->p) >= n;
}

static inline uint64_t
be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) {
        v = v << 8 | p[i];
    }
    return v;
}

/* An array header; -1 if the next object is not an array (or is truncated). */
static Py_ssize_t
read_array_len(Reader *r)
{
    if (!need(r, 1)) {
        return -1;
    }
    uint8_t b = *r->p;
    if ((b & 0xF0) == 0x90) {
        r->p += 1;
        return b & 0x0F;
    }
    if (b == 0xDC && need(r, 3)) {
        r->p += 3;
        return (Py_ssize_t)be(r->p - 2, 2);
    }
    if (b == 0xDD && need(r, 5)) {
        r->p += 5;
        return (Py_ssize_t)be(r->p - 4, 4);
    }
    return -1;
}

/* One token id in any other int encoding; 0 on success, -1 if it is not in [0, 2**32). */
static int
read_token_slow(Reader *r, uint32_t *out)
{
    uint8_t b = *r->p;
    int width;
    int is_signed = 0;
    switch (b) {
    case 0xCF: width = 8; break;
    case 0xD0: width = 1; is_signed = 1; break;
    case 0xD1: width = 2; is_signed = 1; break;
    case 0xD2: width = 4; is_signed = 1; break;
    case 0xD3: width = 8; is_signed = 1; break;
    default: return -1; /* nil, bool, float, str, negative fixint, containers ... */
    }
    if (!need(r, 1 + (size_t)width)) {
        return -1;
    }
    uint64_t v = be(r->p + 1, width);
    if ((is_signed && v >> (8 * width - 1)) || v > 0xFFFFFFFFULL) {
        return -1; /* negative, or past u32 */
    }
    *out = (uint32_t)v;
    r->p += 1 + width;
    return 0;
}

/* One token id; 0 on success, -1 if it is not an int in [0, 2**32). The encodings msgpack
 * writers choose for ids (fixint, uint8/16/32: the smallest that fits) are read inline. */
static inline int
read_token(Reader *r, uint32_t *out)
{
    const uint8_t *p = r->p;
    size_t left = (size_t)(r->end - p);
    if (left == 0) {
        return -1;
    }
    switch (p[0]) {
    case 0xCC:
        if (left < 2) {
            return -1;
        }
        *out = p[1];
        r->p = p + 2;
        return 0;
    case 0xCD:
        if (left < 3) {
            return -1;
        }
        *out = (uint32_t)p[1] << 8 | p[2];
        r->p = p + 3;
        return 0;
    case 0xCE:
        if (left < 5) {
            return -1;
        }
        *out = (uint32_t)p[1] << 24 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 8 | p[4];
        r->p = p + 5;
        return 0;
    default:
        if (p[0] <= 0x7F) {
            *out = p[0];
            r->p = p + 1;
            return 0;
        }
        return read_token_slow(r, out);
    }
}

static PyObject *
py_parse_tokens(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "parse_tokens(raw, max_tokens, pairs) takes 3 arguments");
        return NULL;
    }
    Py_ssize_t cap = PyLong_AsSsize_t(args[1]);
    if (cap == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int pairs = PyObject_IsTrue(args[2]);
    if (pairs < 0) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Reader r = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len};
    PyObject *out = NULL;
    const char *why = "token_ids is not an array";
    Py_ssize_t n = read_array_len(&r);
    if (n < 0) {
        goto fail;
    }
    why = "too many token ids";
    if (n > cap) {
        goto fail;
    }
    out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
    why = pairs ? "a bigram pair is not two token ids" : "a token id is not an int in [0, 2**32)";
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t token, second;
        if (pairs) {
            if (read_array_len(&r) != 2 || read_token(&r, &token) < 0
                || read_token(&r, &second) < 0) {
                goto fail;
            }
        }
        else if (read_token(&r, &token) < 0) {
            goto fail;
        }
        memcpy(dst + 4 * i, &token, 4); /* little-endian host */
    }
    why = "bytes after the token ids";
    if (r.p != r.end) {
        goto fail;
    }
    PyBuffer_Release(&view);
    return out;
fail:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, why);
    return NULL;
}


/* ---- decoded events -> normalized events (twin of router/events.py _normalize_events_py) - */

static PyObject *str_block_hashes, *str_medium, *str_group_idx, *str_locality, *str_normalize;
static PyObject *str_tier, *str_engine_hashes;

/* ignored[reason] += 1, for an event the decoder validated and drops (EventBatch.ignored). */
static int
count_reason(PyObject *ignored, PyObject *reason)
{
    PyObject *count = PyDict_GetItemWithError(ignored, reason);
    if (count == NULL && PyErr_Occurred()) {
        return -1;
    }
    PyObject *next = PyLong_FromSsize_t(count == NULL ? 1 : PyLong_AsSsize_t(count) + 1);
    if (next == NULL || PyErr_Occurred()) {
        Py_XDECREF(next);
        return -1;
    }
    int status = PyDict_SetItem(ignored, reason, next);
    Py_DECREF(next);
    return status;
}

/* The one-block removal with a u64 hash, primary group, local, on a known medium: the
 * BlockRemoved built at once (new reference); NULL with no error when the event is not it. */
static PyObject *
quick_removal(PyObject *ev, PyObject *block_removed, PyObject *removal_tiers, PyObject *zero)
{
    PyObject *result = NULL, *tier;
    PyObject *hashes = PyObject_GetAttr(ev, str_block_hashes);
    PyObject *medium = PyObject_GetAttr(ev, str_medium);
    PyObject *group = PyObject_GetAttr(ev, str_group_idx);
    PyObject *locality = PyObject_GetAttr(ev, str_locality);
    if (hashes == NULL || medium == NULL || group == NULL || locality == NULL) {
        goto done;
    }
    if (!PyList_CheckExact(hashes) || PyList_GET_SIZE(hashes) != 1
        || !PyLong_CheckExact(PyList_GET_ITEM(hashes, 0)) || locality != Py_None) {
        goto done;
    }
    int ok = PyObject_RichCompareBool(PyList_GET_ITEM(hashes, 0), zero, Py_GE);
    if (ok > 0) {
        ok = PyObject_Not(group);
    }
    if (ok <= 0) {
        goto done;
    }
    tier = PyDict_GetItemWithError(removal_tiers, medium);
    if (tier == NULL) {
        goto done;
    }
    PyObject *fields[3] = {hashes, tier, medium};
    result = PyObject_Vectorcall(block_removed, fields, 3, NULL);
done:
    Py_XDECREF(hashes);
    Py_XDECREF(medium);
    Py_XDECREF(group);
    Py_XDECREF(locality);
    return result;
}

/* normalize_events(events, removed_types, BlockRemoved, removal_tiers) -> (out, ignored) */
static PyObject *
py_normalize_events(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_CheckExact(args[0]) || !PyTuple_CheckExact(args[1])
        || !PyDict_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "normalize_events(events: list, removed_types: tuple, "
                                         "BlockRemoved, removal_tiers: dict)");
        return NULL;
    }
    PyObject *events = args[0], *removed_types = args[1], *block_removed = args[2];
    PyObject *removal_tiers = args[3];
    PyObject *zero = PyLong_FromLong(0);
    PyObject *out = PyList_New(0);
    PyObject *ignored = PyDict_New();
    if (zero == NULL || out == NULL || ignored == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        PyObject *result = NULL;
        int removal = 0;
        for (Py_ssize_t t = 0; t < PyTuple_GET_SIZE(removed_types); t++) {
            removal |= (PyObject *)Py_TYPE(ev) == PyTuple_GET_ITEM(removed_types, t);
        }
        if (removal) {
            result = quick_removal(ev, block_removed, removal_tiers, zero);
            if (result == NULL && PyErr_Occurred()) {
                goto error;
            }
        }
        if (result == NULL) {
            result = PyObject_CallMethodNoArgs(ev, str_normalize);
            if (result == NULL) {
                goto error;
            }
            if (PyUnicode_CheckExact(result)) { /* a reason the event is ignored */
                int status = count_reason(ignored, result);
                Py_DECREF(result);
                if (status < 0) {
                    goto error;
                }
                continue;
            }
        }
        int status = PyList_Append(out, result);
        Py_DECREF(result);
        if (status < 0) {
            goto error;
        }
    }
    Py_DECREF(zero);
    return Py_BuildValue("(NN)", out, ignored);
error:
    Py_XDECREF(zero);
    Py_XDECREF(out);
    Py_XDECREF(ignored);
    return NULL;
}


/* ---- whole batches of map events (twin: router/events.py _decode_typed, then generic) ---- */

/* Past this nesting the batch is left to the Python decoders (which have their own limits). */
#define MAX_SKIP_DEPTH 32
#define MAX_ADAPTER_NAME_CHARS 1024 /* cachetree.keys.MAX_ADAPTER_NAME_CHARS */

/* A map or array header; -1 if the next object is neither (or is truncated). */
static Py_ssize_t
read_container_len(Reader *r, int map)
{
    if (!need(r, 1)) {
        return -1;
    }
    uint8_t b = *r->p;
    if ((b & 0xF0) == (map ? 0x80 : 0x90)) {
        r->p += 1;
        return b & 0x0F;
    }
    if (b == (map ? 0xDE : 0xDC) && need(r, 3)) {
        r->p += 3;
        return (Py_ssize_t)be(r->p - 2, 2);
    }
    if (b == (map ? 0xDF : 0xDD) && need(r, 5)) {
        r->p += 5;
        return (Py_ssize_t)be(r->p - 4, 4);
    }
    return -1;
}

/* A str's bytes; 0 if the next object is not a str (or is truncated). */
static int
read_str(Reader *r, const uint8_t **data, size_t *len)
{
    if (!need(r, 1)) {
        return 0;
    }
    uint8_t b = *r->p;
    size_t head, n;
    if ((b & 0xE0) == 0xA0) {
        head = 1;
        n = b & 0x1F;
    }
    else if (b == 0xD9 && need(r, 2)) {
        head = 2;
        n = r->p[1];
    }
    else if (b == 0xDA && need(r, 3)) {
        head = 3;
        n = (size_t)be(r->p + 1, 2);
    }
    else if (b == 0xDB && need(r, 5)) {
        head = 5;
        n = (size_t)be(r->p + 1, 4);
    }
    else {
        return 0;
    }
    if (!need(r, head + n)) {
        return 0;
    }
    *data = r->p + head;
    *len = n;
    r->p += head + n;
    return 1;
}

static inline int
str_is(const uint8_t *data, size_t len, const char *want)
{
    return strlen(want) == len && memcmp(data, want, len) == 0;
}

/* Step over one well-formed object; 0 if it is malformed, truncated, or too deep. */
static int
skip(Reader *r, int depth)
{
    if (!need(r, 1) || depth > MAX_SKIP_DEPTH) {
        return 0;
    }
    uint8_t b = *r->p;
    size_t n;
    if (b <= 0x7F || b >= 0xE0 || b == 0xC0 || b == 0xC2 || b == 0xC3) {
        r->p += 1;
        return 1;
    }
    if ((b & 0xE0) == 0xA0 || b == 0xD9 || b == 0xDA || b == 0xDB) {
        const uint8_t *data;
        return read_str(r, &data, &n);
    }
    if ((b & 0xF0) == 0x90 || (b & 0xF0) == 0x80 || b == 0xDC || b == 0xDD || b == 0xDE
        || b == 0xDF) {
        int map = (b & 0xF0) == 0x80 || b == 0xDE || b == 0xDF;
        Py_ssize_t items = read_container_len(r, map);
        if (items < 0) {
            return 0;
        }
        for (Py_ssize_t i = 0; i < items * (map ? 2 : 1); i++) {
            if (!skip(r, depth + 1)) {
                return 0;
            }
        }
        return 1;
    }
    switch (b) {
    case 0xC4: n = need(r, 2) ? 2 + r->p[1] : 0; break;                         /* bin 8 */
    case 0xC5: n = need(r, 3) ? 3 + (size_t)be(r->p + 1, 2) : 0; break;         /* bin 16 */
    case 0xC6: n = need(r, 5) ? 5 + (size_t)be(r->p + 1, 4) : 0; break;         /* bin 32 */
    case 0xCA: n = 5; break;
    case 0xCB: n = 9; break;
    case 0xCC: case 0xD0: n = 2; break;
    case 0xCD: case 0xD1: n = 3; break;
    case 0xCE: case 0xD2: n = 5; break;
    case 0xCF: case 0xD3: n = 9; break;
    default: return 0; /* ext types, the reserved byte: the Python decoders decide */
    }
    if (n == 0 || !need(r, n)) {
        return 0;
    }
    r->p += n;
    return 1;
}

/* A non-negative int of any encoding as u64; 0 if the next object is not one. */
static int
read_u64(Reader *r, uint64_t *out)
{
    if (!need(r, 1)) {
        return 0;
    }
    uint8_t b = *r->p;
    if (b <= 0x7F) {
        *out = b;
        r->p += 1;
        return 1;
    }
    int width;
    int is_signed = b >= 0xD0;
    switch (b) {
    case 0xCC: case 0xD0: width = 1; break;
    case 0xCD: case 0xD1: width = 2; break;
    case 0xCE: case 0xD2: width = 4; break;
    case 0xCF: case 0xD3: width = 8; break;
    default: return 0;
    }
    if (!need(r, 1 + (size_t)width)) {
        return 0;
    }
    uint64_t v = be(r->p + 1, width);
    if (is_signed && v >> (8 * width - 1)) {
        return 0;
    }
    *out = v;
    r->p += 1 + width;
    return 1;
}

static inline int
read_nil(Reader *r)
{
    if (need(r, 1) && *r->p == 0xC0) {
        r->p += 1;
        return 1;
    }
    return 0;
}

/* A medium (NULL: nil) found among the keys of `tiers` ({medium: tier}), as the dict's own
 * key object ("GPU", ...): no new str per event, and the events of a run share it. 0 when it
 * is not there (an unusual medium is left to the Python decoders). Borrowed references. */
static int
known_medium(PyObject *tiers, const uint8_t *medium, size_t len, PyObject **key, PyObject **tier)
{
    PyObject *name, *name_tier;
    Py_ssize_t pos = 0;
    while (PyDict_Next(tiers, &pos, &name, &name_tier)) {
        if (medium == NULL ? name == Py_None
                           : (PyUnicode_CheckExact(name) && PyUnicode_IS_COMPACT_ASCII(name)
                              && (size_t)PyUnicode_GET_LENGTH(name) == len
                              && memcmp(PyUnicode_DATA(name), medium, len) == 0)) {
            *key = name;
            *tier = name_tier;
            return 1;
        }
    }
    return 0;
}

/* nil, or a str of ASCII bytes (the Python decoders check anything else's UTF-8): its bytes
 * (NULL for nil). 0 if the next object is neither. */
static int
read_ascii_or_nil(Reader *r, const uint8_t **data, size_t *len)
{
    if (read_nil(r)) {
        *data = NULL;
        *len = 0;
        return 1;
    }
    if (!read_str(r, data, len)) {
        return 0;
    }
    for (size_t i = 0; i < *len; i++) {
        if ((*data)[i] >= 0x80) {
            return 0;
        }
    }
    return 1;
}

/* A block hash as the decoder normalizes it (router/events.py `_u64`): an int64 or uint64 as
 * u64 (two's complement), `bin` of 1..max_bytes bytes as its last 8 bytes big-endian. 0 if
 * the next object is neither. */
static int
read_hash(Reader *r, Py_ssize_t max_bytes, uint64_t *out)
{
    if (!need(r, 1)) {
        return 0;
    }
    uint8_t b = *r->p;
    if (b >= 0xE0) { /* negative fixint */
        *out = (uint64_t)(int64_t)(int8_t)b;
        r->p += 1;
        return 1;
    }
    if (b >= 0xD0 && b <= 0xD3) { /* int8..int64, negative ones sign-extended */
        int width = 1 << (b - 0xD0);
        if (!need(r, 1 + (size_t)width)) {
            return 0;
        }
        uint64_t v = be(r->p + 1, width);
        if (width < 8 && v >> (8 * width - 1)) {
            v |= ~0ULL << (8 * width);
        }
        *out = v;
        r->p += 1 + width;
        return 1;
    }
    if (b == 0xC4 || b == 0xC5 || b == 0xC6) { /* bin 8/16/32 */
        size_t head = b == 0xC4 ? 2 : b == 0xC5 ? 3 : 5;
        if (!need(r, head)) {
            return 0;
        }
        size_t n = (size_t)be(r->p + 1, (int)head - 1);
        if (n < 1 || n > (size_t)max_bytes || !need(r, head + n)) {
            return 0;
        }
        size_t tail = n < 8 ? n : 8;
        *out = be(r->p + head + n - tail, (int)tail);
        r->p += head + n;
        return 1;
    }
    return read_u64(r, out);
}

/* An event map that is the one-block removal an evicting engine sends:
 * {"type": "BlockRemoved", "block_hashes": [u64], "medium": str|nil, "group_idx": 0|nil,
 *  "locality": nil} with no other key and no key twice, its medium among `removal_tiers`.
 * Returns 1 with its hash, where the hash's encoding starts (`*hash_at`), its medium (the key
 * of `removal_tiers`) and its tier (borrowed), or 0 when the event is any other (the reader is
 * then left anywhere: the caller rewinds). Sets no error. */
static int
parse_removal_map(Reader *r, PyObject *removal_tiers, uint64_t *hash_out,
                  const uint8_t **hash_at, PyObject **medium_out, PyObject **tier_out)
{
    Py_ssize_t keys = read_container_len(r, 1);
    int seen_type = 0, seen_hashes = 0, seen_medium = 0, seen_group = 0, seen_locality = 0;
    uint64_t hash = 0;
    const uint8_t *medium = NULL;
    size_t medium_len = 0;
    if (keys < 2) {
        return 0;
    }
    for (Py_ssize_t k = 0; k < keys; k++) {
        const uint8_t *key, *value;
        size_t key_len, value_len;
        if (!read_str(r, &key, &key_len)) {
            return 0;
        }
        if (str_is(key, key_len, "type") && !seen_type++) {
            if (!read_str(r, &value, &value_len) || !str_is(value, value_len, "BlockRemoved")) {
                return 0;
            }
        }
        else if (str_is(key, key_len, "block_hashes") && !seen_hashes++) {
            if (read_container_len(r, 0) != 1) {
                return 0;
            }
            *hash_at = r->p;
            if (!read_u64(r, &hash)) {
                return 0;
            }
        }
        else if (str_is(key, key_len, "medium") && !seen_medium++) {
            if (!read_nil(r)) {
                if (!read_str(r, &medium, &medium_len)) {
                    return 0;
                }
                for (size_t i = 0; i < medium_len; i++) {
                    if (medium[i] >= 0x80) {
                        return 0; /* the Python decoders check the UTF-8 */
                    }
                }
            }
        }
        else if (str_is(key, key_len, "group_idx") && !seen_group++) {
            uint64_t group;
            if (!read_nil(r) && !(read_u64(r, &group) && group == 0)) {
                return 0;
            }
        }
        else if (str_is(key, key_len, "locality") && !seen_locality++) {
            if (!read_nil(r)) {
                return 0;
            }
        }
        else {
            return 0; /* another key, or one twice */
        }
    }
    if (!seen_type || !seen_hashes) {
        return 0;
    }
    if (!known_medium(removal_tiers, medium, medium_len, medium_out, tier_out)) {
        return 0;
    }
    *hash_out = hash;
    return 1;
}

/* parse_removal_map's event as a BlockRemoved (new reference), or NULL with no error when the
 * event is any other. */
static PyObject *
quick_removal_map(Reader *r, PyObject *removal_tiers, PyObject *block_removed)
{
    uint64_t hash;
    const uint8_t *hash_at;
    PyObject *medium_obj, *tier;
    if (!parse_removal_map(r, removal_tiers, &hash, &hash_at, &medium_obj, &tier)) {
        return NULL;
    }
    Py_INCREF(medium_obj);
    PyObject *result = NULL, *hash_obj = NULL, *hashes = NULL;
    hash_obj = PyLong_FromUnsignedLongLong(hash);
    hashes = hash_obj == NULL ? NULL : PyList_New(1);
    if (hashes == NULL) {
        goto done;
    }
    Py_INCREF(hash_obj);
    PyList_SET_ITEM(hashes, 0, hash_obj);
    PyObject *fields[3] = {hashes, tier, medium_obj};
    result = PyObject_Vectorcall(block_removed, fields, 3, NULL);
done:
    Py_XDECREF(hash_obj);
    Py_XDECREF(hashes);
    Py_DECREF(medium_obj);
    return result;
}

/* What decode_map_batch needs from router/events.py, unpacked from its `spec` tuple once per
 * batch (borrowed references). */
typedef struct {
    PyObject *removal_tiers; /* {medium: tier or None}: what a BlockRemoved clears */
    PyObject *stored_tiers;  /* {medium: tier}: where a BlockStored is stored */
    PyObject *block_removed, *block_stored, *token_ids, *event_batch; /* the output types */
    Py_ssize_t max_hashes, max_tokens, max_hash_bytes;                /* the caps */
} MapSpec;

static PyObject *str_uint32_code; /* "I", TokenIds' typecode */

/* An event map that is a BlockStored as engines send it, built here without an intermediate
 * struct: the fields of router/events.py `_MapStored` (type, block_hashes, parent_block_hash,
 * token_ids, block_size, medium, lora_name, cache_salt, group_idx, kv_cache_spec_kind,
 * locality) each at most once, any other key skipped as msgspec skips it; flat token ids;
 * at least one hash, within the caps; the token count that many blocks; a medium among
 * `stored_tiers`; lora_name nil or ASCII, not empty and without a NUL; cache_salt, kv_cache_spec_kind and locality nil;
 * group_idx nil or 0. Returns the BlockStored (new reference), or NULL with no error when the
 * event is any other (or on an error, set; the reader is then left anywhere: the caller
 * rewinds). What is refused here is decoded by the Python decoders, which decide everything
 * else (ignored events, bigram pairs, salts, errors). */
static PyObject *
quick_stored_map(Reader *r, const MapSpec *spec)
{
    Py_ssize_t keys = read_container_len(r, 1);
    int seen_type = 0, seen_hashes = 0, seen_parent = 0, seen_tokens = 0, seen_size = 0;
    int seen_medium = 0, seen_lora = 0, seen_salt = 0, seen_group = 0, seen_kind = 0;
    int seen_locality = 0, has_parent = 0;
    const uint8_t *hashes_at = NULL, *medium = NULL, *lora = NULL;
    size_t medium_len = 0, lora_len = 0;
    Py_ssize_t n_hashes = 0, n_tokens = 0;
    uint64_t parent = 0, block_size = 0, scratch;
    PyObject *tokens = NULL, *result = NULL;
    if (keys < 4) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < keys; k++) {
        const uint8_t *key, *value;
        size_t key_len, value_len;
        if (!read_str(r, &key, &key_len)) {
            goto done;
        }
        if (str_is(key, key_len, "type")) {
            if (seen_type++ || !read_str(r, &value, &value_len)
                || !str_is(value, value_len, "BlockStored")) {
                goto done;
            }
        }
        else if (str_is(key, key_len, "block_hashes")) {
            n_hashes = read_array_len(r);
            if (seen_hashes++ || n_hashes < 1 || n_hashes > spec->max_hashes) {
                goto done;
            }
            hashes_at = r->p; /* read again below, once the event is known to be taken */
            for (Py_ssize_t i = 0; i < n_hashes; i++) {
                if (!read_hash(r, spec->max_hash_bytes, &scratch)) {
                    goto done;
                }
            }
        }
        else if (str_is(key, key_len, "parent_block_hash")) {
            if (seen_parent++) {
                goto done;
            }
            if (!read_nil(r)) {
                if (!read_hash(r, spec->max_hash_bytes, &parent)) {
                    goto done;
                }
                has_parent = 1;
            }
        }
        else if (str_is(key, key_len, "token_ids")) {
            n_tokens = read_array_len(r);
            if (seen_tokens++ || n_tokens < 0 || n_tokens > spec->max_tokens) {
                goto done;
            }
            tokens = PyBytes_FromStringAndSize(NULL, n_tokens * 4);
            if (tokens == NULL) {
                goto done;
            }
            uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(tokens);
            for (Py_ssize_t i = 0; i < n_tokens; i++) {
                uint32_t token;
                if (read_token(r, &token) < 0) {
                    goto done; /* bigram pairs, or not an id: the Python decoders */
                }
                memcpy(dst + 4 * i, &token, 4); /* little-endian host */
            }
        }
        else if (str_is(key, key_len, "block_size")) {
            if (seen_size++ || !read_u64(r, &block_size) || block_size < 1) {
                goto done;
            }
        }
        else if (str_is(key, key_len, "medium")) {
            if (seen_medium++ || !read_ascii_or_nil(r, &medium, &medium_len)) {
                goto done;
            }
        }
        else if (str_is(key, key_len, "lora_name")) {
            if (seen_lora++ || !read_ascii_or_nil(r, &lora, &lora_len)) {
                goto done;
            }
        }
        else if (str_is(key, key_len, "group_idx")) {
            if (seen_group++ || !(read_nil(r) || (read_u64(r, &scratch) && scratch == 0))) {
                goto done;
            }
        }
        else if (str_is(key, key_len, "cache_salt")) {
            if (seen_salt++ || !read_nil(r)) {
                goto done;
            }
        }
        else if (str_is(key, key_len, "kv_cache_spec_kind")) {
            if (seen_kind++ || !read_nil(r)) {
                goto done;
            }
        }
        else if (str_is(key, key_len, "locality")) {
            if (seen_locality++ || !read_nil(r)) {
                goto done;
            }
        }
        else if (!skip(r, 0)) { /* a key _MapStored does not have (lora_id, extra_keys ...) */
            goto done;
        }
    }
    if (!seen_type || !seen_hashes || !seen_tokens || !seen_size
        || n_tokens % n_hashes != 0 || (uint64_t)(n_tokens / n_hashes) != block_size) {
        goto done;
    }
    if (lora != NULL
        && (lora_len == 0 || lora_len > MAX_ADAPTER_NAME_CHARS || memchr(lora, 0, lora_len) != NULL)) {
        goto done; /* no adapter's name (is_adapter_name): the Python decoders refuse it */
    }
    PyObject *medium_obj, *tier;
    if (!known_medium(spec->stored_tiers, medium, medium_len, &medium_obj, &tier)) {
        goto done;
    }
    PyObject *hashes = PyList_New(n_hashes);
    PyObject *parent_obj = has_parent ? PyLong_FromUnsignedLongLong(parent) : Py_NewRef(Py_None);
    PyObject *namespace = lora == NULL ? Py_NewRef(Py_None)
                                       : PyUnicode_FromStringAndSize((const char *)lora,
                                                                     (Py_ssize_t)lora_len);
    PyObject *size_obj = PyLong_FromUnsignedLongLong(block_size);
    PyObject *packed_args[2] = {str_uint32_code, tokens};
    PyObject *packed = PyObject_Vectorcall(spec->token_ids, packed_args, 2, NULL);
    if (hashes != NULL && parent_obj != NULL && namespace != NULL && size_obj != NULL
        && packed != NULL) {
        Reader again = {hashes_at, r->end};
        Py_ssize_t i = 0;
        for (; i < n_hashes; i++) {
            read_hash(&again, spec->max_hash_bytes, &scratch); /* checked above */
            PyObject *h = PyLong_FromUnsignedLongLong(scratch);
            if (h == NULL) {
                break;
            }
            PyList_SET_ITEM(hashes, i, h);
        }
        if (i == n_hashes) {
            PyObject *fields[7] = {hashes, parent_obj, packed, size_obj, tier, medium_obj,
                                   namespace};
            result = PyObject_Vectorcall(spec->block_stored, fields, 7, NULL);
        }
    }
    Py_XDECREF(hashes);
    Py_XDECREF(parent_obj);
    Py_XDECREF(namespace);
    Py_XDECREF(size_obj);
    Py_XDECREF(packed);
done:
    Py_XDECREF(tokens);
    return result;
}

/* The last one-block removal parse_removal_map accepted in a batch, as bytes: an engine
 * evicting sends dozens of them in a row that differ only in the hash, so the next one is
 * recognized by comparing its bytes with this one's around the hash (an unsigned int of the
 * same width) instead of parsing its five keys again. Every byte but the hash's being the
 * same, it is the same map: the same keys, medium and tier, with that hash. */
typedef struct {
    const uint8_t *start; /* NULL: none yet */
    size_t len, at, width; /* the event's bytes; where its hash's marker is; the hash's bytes */
    PyObject *medium, *tier; /* what it resolved to (borrowed from the spec's removal_tiers) */
} Removal;

static void
removal_remember(Removal *t, const uint8_t *start, const uint8_t *end, const uint8_t *hash_at,
                 PyObject *medium, PyObject *tier)
{
    size_t width;
    switch (*hash_at) {
    case 0xCC: width = 1; break;
    case 0xCD: width = 2; break;
    case 0xCE: width = 4; break;
    case 0xCF: width = 8; break;
    default: t->start = NULL; return; /* a fixint's value is its marker: no template */
    }
    *t = (Removal){start, (size_t)(end - start), (size_t)(hash_at - start), width, medium, tier};
}

/* 1 and the hash when the event at r->p is the remembered removal with another hash (the
 * reader then moves past it), else 0 with the reader unmoved. */
static int
removal_again(const Removal *t, Reader *r, uint64_t *hash)
{
    const uint8_t *p = r->p;
    size_t tail = t->at + 1 + t->width;
    if (t->start == NULL || (size_t)(r->end - p) < t->len || p[t->at] != t->start[t->at]
        || memcmp(p, t->start, t->at) != 0
        || memcmp(p + tail, t->start + tail, t->len - tail) != 0) {
        return 0;
    }
    *hash = be(p + t->at + 1, (int)t->width);
    r->p = p + t->len;
    return 1;
}

/* The run of one-block removals being folded when decode_map_batch is given RemovedRun (twin:
 * router/events.py fold_removal_runs): its hash list, medium and tier, borrowed from the
 * RemovedRun already in the output list; `hashes` is NULL while no run is open. */
typedef struct {
    PyObject *run_type; /* RemovedRun, or NULL: no folding */
    PyObject *hashes, *medium, *tier;
} Fold;

static int
same_value(PyObject *a, PyObject *b)
{
    return a == b ? 1 : PyObject_RichCompareBool(a, b, Py_EQ);
}

/* One one-block removal (`hash_obj` borrowed) onto the open run when it has the same medium
 * and tier, else into a new RemovedRun appended to `out`. 0, or -1 with an error set. */
static int
fold_removal(Fold *f, PyObject *out, PyObject *hash_obj, PyObject *medium, PyObject *tier)
{
    if (f->hashes != NULL) {
        int same = same_value(f->medium, medium);
        if (same > 0) {
            same = same_value(f->tier, tier);
        }
        if (same < 0) {
            return -1;
        }
        if (same) {
            return PyList_Append(f->hashes, hash_obj);
        }
    }
    PyObject *hashes = PyList_New(1);
    if (hashes == NULL) {
        return -1;
    }
    Py_INCREF(hash_obj);
    PyList_SET_ITEM(hashes, 0, hash_obj);
    PyObject *fields[3] = {hashes, tier, medium};
    PyObject *run = PyObject_Vectorcall(f->run_type, fields, 3, NULL);
    Py_DECREF(hashes);
    if (run == NULL) {
        return -1;
    }
    int status = PyList_Append(out, run);
    Py_DECREF(run);
    if (status < 0) {
        return -1;
    }
    f->hashes = hashes; /* the run in `out` holds these three */
    f->medium = medium;
    f->tier = tier;
    return 0;
}

/* A decoded event folded when it is a one-block BlockRemoved: 1 folded, 0 not (the open run
 * ends: the event goes to the output as it is), -1 on an error. */
static int
fold_event(Fold *f, PyObject *out, PyObject *event, PyObject *block_removed)
{
    if ((PyObject *)Py_TYPE(event) != block_removed) {
        f->hashes = NULL;
        return 0;
    }
    PyObject *hashes = PyObject_GetAttr(event, str_engine_hashes);
    if (hashes == NULL) {
        return -1;
    }
    if (!PyList_CheckExact(hashes) || PyList_GET_SIZE(hashes) != 1) {
        Py_DECREF(hashes);
        f->hashes = NULL;
        return 0;
    }
    int status = -1;
    PyObject *medium = PyObject_GetAttr(event, str_medium);
    PyObject *tier = medium == NULL ? NULL : PyObject_GetAttr(event, str_tier);
    if (tier != NULL) {
        status = fold_removal(f, out, PyList_GET_ITEM(hashes, 0), medium, tier) < 0 ? -1 : 1;
    }
    Py_XDECREF(tier);
    Py_XDECREF(medium);
    Py_DECREF(hashes);
    return status;
}

/* decode_map_batch(payload, spec, decode_event, run_type=None) -> EventBatch, or None when the
 *   batch is not `[ts, [map event, ...], dp_rank?]` as engines send it (the caller then runs
 *   the Python decoders, which decide everything). `spec` is (removal_tiers, stored_tiers, BlockRemoved,
 *   BlockStored, TokenIds, EventBatch, max_hashes, max_tokens, max_hash_bytes).
 * One-block removals and the usual BlockStored are built here; every other event's bytes go
 * to `decode_event` with the event's index in the batch, which returns its normalized event
 * or the reason it is ignored, or raises (naming the event: the error passes through). With
 * `run_type` (RemovedRun; None or absent: not), runs of one-block removals of one medium come
 * as one RemovedRun each (`Fold`), with no event built per block. */
static PyObject *
py_decode_map_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    MapSpec spec;
    if ((nargs != 3 && nargs != 4) || !PyTuple_CheckExact(args[1])
        || PyTuple_GET_SIZE(args[1]) != 9
        || !PyDict_CheckExact(PyTuple_GET_ITEM(args[1], 0))
        || !PyDict_CheckExact(PyTuple_GET_ITEM(args[1], 1))) {
        PyErr_SetString(PyExc_TypeError, "decode_map_batch(payload, spec: tuple of 9, "
                                         "decode_event, run_type=None); see router/events.py "
                                         "_MAP_BATCH_SPEC");
        return NULL;
    }
    PyObject *const *items = &PyTuple_GET_ITEM(args[1], 0);
    spec = (MapSpec){items[0], items[1], items[2], items[3], items[4], items[5],
                     PyLong_AsSsize_t(items[6]), PyLong_AsSsize_t(items[7]),
                     PyLong_AsSsize_t(items[8])};
    if (PyErr_Occurred()) {
        return NULL;
    }
    PyObject *decode_event = args[2];
    Fold fold = {nargs == 4 && args[3] != Py_None ? args[3] : NULL, NULL, NULL, NULL};
    Removal last_removal = {NULL};
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *out = NULL, *ignored = NULL, *ts_obj = NULL, *dp_obj = NULL, *result = NULL;
    Reader r = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len};
    Py_ssize_t root = read_container_len(&r, 0);
    double ts;
    if ((root != 2 && root != 3) || !need(&r, 1)) {
        goto bail;
    }
    uint8_t b = *r.p;
    uint64_t u;
    if (b == 0xCB && need(&r, 9)) {
        uint64_t bits = be(r.p + 1, 8);
        memcpy(&ts, &bits, 8);
        r.p += 9;
    }
    else if (b == 0xCA && need(&r, 5)) {
        uint32_t bits = (uint32_t)be(r.p + 1, 4);
        float f;
        memcpy(&f, &bits, 4);
        ts = f;
        r.p += 5;
    }
    else if (read_u64(&r, &u)) {
        ts = (double)u;
    }
    else {
        goto bail;
    }
    if (!isfinite(ts)) {
        goto bail;
    }
    Py_ssize_t events = read_container_len(&r, 0);
    if (events < 0) {
        goto bail;
    }
    out = PyList_New(0);
    ignored = PyDict_New();
    if (out == NULL || ignored == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < events; i++) {
        const uint8_t *start = r.p;
        if (!need(&r, 1) || !((*r.p & 0xF0) == 0x80 || *r.p == 0xDE || *r.p == 0xDF)) {
            goto bail; /* positional events, or not an event */
        }
        PyObject *event = NULL;
        if (fold.run_type != NULL) {
            uint64_t hash;
            const uint8_t *hash_at;
            PyObject *medium, *tier;
            int removal = removal_again(&last_removal, &r, &hash);
            if (removal) {
                medium = last_removal.medium;
                tier = last_removal.tier;
            }
            else if (parse_removal_map(&r, spec.removal_tiers, &hash, &hash_at, &medium, &tier)) {
                removal = 1;
                removal_remember(&last_removal, start, r.p, hash_at, medium, tier);
            }
            if (removal) {
                PyObject *hash_obj = PyLong_FromUnsignedLongLong(hash);
                int status = -1;
                if (hash_obj != NULL) {
                    status = fold_removal(&fold, out, hash_obj, medium, tier);
                    Py_DECREF(hash_obj);
                }
                if (status < 0) {
                    goto error;
                }
                continue;
            }
        }
        else {
            event = quick_removal_map(&r, spec.removal_tiers, spec.block_removed);
        }
        if (event == NULL && !PyErr_Occurred()) {
            r.p = start;
            event = quick_stored_map(&r, &spec);
        }
        if (event == NULL) {
            if (PyErr_Occurred()) {
                goto error;
            }
            r.p = start;
            if (!skip(&r, 0)) {
                goto bail;
            }
            PyObject *span = PyBytes_FromStringAndSize((const char *)start, r.p - start);
            if (span == NULL) {
                goto error;
            }
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL) {
                Py_DECREF(span);
                goto error;
            }
            PyObject *call_args[2] = {span, index};
            event = PyObject_Vectorcall(decode_event, call_args, 2, NULL);
            Py_DECREF(span);
            Py_DECREF(index);
            if (event == NULL) {
                goto error;
            }
            if (PyUnicode_CheckExact(event)) { /* the reason it is ignored */
                int status = count_reason(ignored, event);
                Py_DECREF(event);
                if (status < 0) {
                    goto error;
                }
                continue;
            }
        }
        if (fold.run_type != NULL) {
            int folded = fold_event(&fold, out, event, spec.block_removed);
            if (folded != 0) {
                Py_DECREF(event);
                if (folded < 0) {
                    goto error;
                }
                continue;
            }
        }
        int status = PyList_Append(out, event);
        Py_DECREF(event);
        if (status < 0) {
            goto error;
        }
    }
    if (root == 3) {
        if (read_nil(&r)) {
            dp_obj = Py_None;
            Py_INCREF(dp_obj);
        }
        else if (read_u64(&r, &u)) {
            dp_obj = PyLong_FromUnsignedLongLong(u);
            if (dp_obj == NULL) {
                goto error;
            }
        }
        else {
            goto bail;
        }
    }
    else {
        dp_obj = Py_None;
        Py_INCREF(dp_obj);
    }
    if (r.p != r.end) {
        goto bail;
    }
    ts_obj = PyFloat_FromDouble(ts);
    if (ts_obj == NULL) {
        goto error;
    }
    PyObject *fields[4] = {ts_obj, out, dp_obj, ignored};
    result = PyObject_Vectorcall(spec.event_batch, fields, 4, NULL);
    goto error; /* the common exit: release, return `result` (NULL on an error) */
bail:
    result = Py_None;
    Py_INCREF(result);
error:
    Py_XDECREF(out);
    Py_XDECREF(ignored);
    Py_XDECREF(ts_obj);
    Py_XDECREF(dp_obj);
    PyBuffer_Release(&view);
    return result;
}


/* ---- runs of removals (twin: router/index.py _removal_run_py) --------------------------- */

/* removal_run(events, start, BlockRemoved) -> (end, hashes) */
static PyObject *
py_removal_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_CheckExact(args[0]) || !PyType_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "removal_run(events: list, start, BlockRemoved)");
        return NULL;
    }
    PyObject *events = args[0], *removed_type = args[2];
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(events);
    if (start < 0 || start >= n) {
        PyErr_SetString(PyExc_IndexError, "removal_run: start out of range");
        return NULL;
    }
    PyObject *first = PyList_GET_ITEM(events, start);
    PyObject *tier = PyObject_GetAttr(first, str_tier);
    PyObject *medium = tier == NULL ? NULL : PyObject_GetAttr(first, str_medium);
    PyObject *first_hashes = medium == NULL ? NULL : PyObject_GetAttr(first, str_engine_hashes);
    PyObject *hashes = first_hashes == NULL ? NULL : PySequence_List(first_hashes);
    PyObject *result = NULL;
    Py_XDECREF(first_hashes);
    if (hashes == NULL) {
        goto done;
    }
    Py_ssize_t i = start + 1;
    for (; i < n; i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        if ((PyObject *)Py_TYPE(event) != removed_type) {
            break;
        }
        PyObject *t = PyObject_GetAttr(event, str_tier);
        if (t == NULL) {
            goto done;
        }
        int same = PyObject_RichCompareBool(t, tier, Py_EQ);
        Py_DECREF(t);
        if (same > 0) {
            PyObject *m = PyObject_GetAttr(event, str_medium);
            if (m == NULL) {
                goto done;
            }
            same = PyObject_RichCompareBool(m, medium, Py_EQ);
            Py_DECREF(m);
        }
        if (same < 0) {
            goto done;
        }
        if (!same) {
            break;
        }
        PyObject *more = PyObject_GetAttr(event, str_engine_hashes);
        if (more == NULL) {
            goto done;
        }
        PyObject *seq = PySequence_Fast(more, "engine_hashes must be a sequence");
        Py_DECREF(more);
        if (seq == NULL) {
            goto done;
        }
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(seq); k++) {
            if (PyList_Append(hashes, PySequence_Fast_GET_ITEM(seq, k)) < 0) {
                Py_DECREF(seq);
                goto done;
            }
        }
        Py_DECREF(seq);
    }
    result = Py_BuildValue("(nO)", i, hashes);
done:
    Py_XDECREF(tier);
    Py_XDECREF(medium);
    Py_XDECREF(hashes);
    return result;
}

/* ---- cache_aware's cost rows (twin: router/policy.py _cost_rows_py) ---------------------- */

/* What a candidate's list holds at i, as a double; an int or a float (else -1, error set). */
static inline int
item_double(PyObject *list, Py_ssize_t i, double *out)
{
    PyObject *item = PyList_GET_ITEM(list, i);
    *out = PyFloat_CheckExact(item) ? PyFloat_AS_DOUBLE(item) : PyFloat_AsDouble(item);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static inline int
item_long(PyObject *list, Py_ssize_t i, long long *out)
{
    *out = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* The float operations below are the twin's, in its order: no fused multiply-add may merge
 * two of them (it rounds once where Python rounds twice), so contraction is off here. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

/* cost_rows(ranks, loads, any_tier, capacities, demands, helds, depths, tokens, block, blocks,
 *           per_token, per_request, lower, unseen, evict, fill) -> (costs, evicted, room):
 * router/policy.py _cost_rows_py, float for float. The sequences are lists of one length; a
 * load is an int or a float (the queue term's, `_queued`), a capacity an int or None
 * (unknown, as 0). Integers are read as signed 64-bit words (OverflowError past them, where
 * the twin would compute on); the sums, differences and products of them are taken in 128
 * bits, exact as the twin's ints, and rounded to a double once as Python rounds an int, so
 * no value of a word overflows (`2 * capacity - held` did, undefined, from a capacity of
 * 2**62: router.loads bounds what engines state to 2**48). A comparison of such an int with
 * a float is exact in the twin and made on the int's double here: the same below 2**53. */
#if !defined(__SIZEOF_INT128__)
#error "cost_rows needs a 128-bit integer type (GCC or Clang on a 64-bit target)"
#endif
typedef __int128 wide;
static PyObject *
py_cost_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 16) {
        PyErr_SetString(PyExc_TypeError, "cost_rows takes 16 arguments (_cost_rows_py's)");
        return NULL;
    }
    PyObject *ranks = args[0], *loads = args[1], *any_tier = args[2], *capacities = args[3];
    PyObject *demands = args[4], *helds = args[5], *depths = args[6];
    if (!PyList_CheckExact(ranks) || !PyList_CheckExact(loads) || !PyDict_CheckExact(any_tier)
        || !PyList_CheckExact(capacities) || !PyList_CheckExact(demands)
        || !PyList_CheckExact(helds) || !PyList_CheckExact(depths)) {
        PyErr_SetString(PyExc_TypeError, "cost_rows: lists, and a dict of any-tier depths");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ranks);
    if (PyList_GET_SIZE(loads) != n || PyList_GET_SIZE(capacities) != n
        || PyList_GET_SIZE(demands) != n || PyList_GET_SIZE(helds) != n
        || PyList_GET_SIZE(depths) != n) {
        PyErr_SetString(PyExc_ValueError, "cost_rows: the candidate lists differ in length");
        return NULL;
    }
    double tokens = PyFloat_AsDouble(args[7]);
    long long block = PyLong_AsLongLong(args[8]), blocks = PyLong_AsLongLong(args[9]);
    double per_token = PyFloat_AsDouble(args[10]), per_request = PyFloat_AsDouble(args[11]);
    double lower = PyFloat_AsDouble(args[12]), unseen = PyFloat_AsDouble(args[13]);
    double evict = PyFloat_AsDouble(args[14]), fill = PyFloat_AsDouble(args[15]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    /* The fleet's fullness of demand (the twin's first pass). */
    wide known = 0;
    long long fallback = 0;
    double others = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *cap_obj = PyList_GET_ITEM(capacities, i);
        if (cap_obj == Py_None) {
            continue;
        }
        long long capacity, held;
        double demand;
        if (item_long(capacities, i, &capacity) < 0 || item_double(demands, i, &demand) < 0
            || item_long(helds, i, &held) < 0) {
            return NULL;
        }
        if (!capacity) {
            continue;
        }
        known += capacity;
        if (capacity > fallback) {
            fallback = capacity;
        }
        others += (double)held > demand ? demand + unseen * ((double)held - demand) : demand;
    }
    double fleet = 0.0;
    if (known) {
        double x = others / (double)known;
        fleet = 1.0 < x ? 1.0 : x; /* min(x, 1.0) keeps x unless 1.0 < x */
    }
    PyObject *costs = PyList_New(n), *evicted = PyList_New(n), *room = PyList_New(n);
    if (costs == NULL || evicted == NULL || room == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long held, depth, capacity = 0, a = 0;
        double load, demand;
        PyObject *cap_obj = PyList_GET_ITEM(capacities, i);
        if (item_double(loads, i, &load) < 0 || item_double(demands, i, &demand) < 0
            || item_long(helds, i, &held) < 0 || item_long(depths, i, &depth) < 0
            || (cap_obj != Py_None && item_long(capacities, i, &capacity) < 0)) {
            goto error;
        }
        PyObject *a_obj = PyDict_GetItemWithError(any_tier, PyList_GET_ITEM(ranks, i));
        if (a_obj == NULL && PyErr_Occurred()) {
            goto error;
        }
        if (a_obj != NULL && ((a = PyLong_AsLongLong(a_obj)) == -1 && PyErr_Occurred())) {
            goto error;
        }
        double saved = a > depth ? lower * (double)a + ((double)block - lower) * (double)depth
                                 : (double)((wide)block * depth);
        double cost = per_token * (saved < tokens ? tokens - saved : 0.0)
                      + per_request * load;
        double spilled = 0.0;
        double rm;
        if (!capacity) {
            rm = (double)(2 * (wide)fallback - held) - demand;
        }
        else {
            rm = (double)(2 * (wide)capacity - held) - demand;
            wide fresh = depth < blocks ? (wide)blocks - depth : 0;
            if (fresh) {
                double other = demand > (double)depth ? demand - (double)depth : 0.0;
                if (unseen != 0.0 && (double)held > demand) {
                    other += unseen * ((double)held - demand);
                }
                wide free = capacity > held ? (wide)capacity - held : 0;
                double bound = (double)capacity - other - (double)depth;
                /* max(free, bound): free unless bound > free */
                double spill = (double)fresh - (bound > (double)free ? bound : (double)free);
                if (spill > 0) {
                    spilled = ceil(spill); /* an int of any size, as math.ceil's */
                }
                double occupied = other + (double)depth;
                double fullness = occupied < (double)capacity ? occupied / (double)capacity : 1.0;
                double kept = 0.0 > spill ? 0.0 : spill; /* max(spill, 0.0) */
                cost += (double)block
                        * (evict * kept + fill * fleet * fullness * (double)fresh);
            }
        }
        PyObject *c = PyFloat_FromDouble(cost), *e = PyLong_FromDouble(spilled);
        PyObject *r = PyFloat_FromDouble(rm);
        if (c == NULL || e == NULL || r == NULL) {
            Py_XDECREF(c);
            Py_XDECREF(e);
            Py_XDECREF(r);
            goto error;
        }
        PyList_SET_ITEM(costs, i, c);
        PyList_SET_ITEM(evicted, i, e);
        PyList_SET_ITEM(room, i, r);
    }
    return Py_BuildValue("(NNN)", costs, evicted, room);
error:
    Py_XDECREF(costs);
    Py_XDECREF(evicted);
    Py_XDECREF(room);
    return NULL;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

static PyMethodDef methods[] = {
    {"xxh3_64", (PyCFunction)(void (*)(void))py_xxh3_64, METH_FASTCALL,
     "xxh3_64(data, seed) -> int: XXH3-64 of a bytes-like object."},
    {"block_keys", (PyCFunction)(void (*)(void))py_block_keys, METH_FASTCALL,
     "block_keys(token_ids, block_size, seed) -> list[int]: chained keys of every full block."},
    {"parse_tokens", (PyCFunction)(void (*)(void))py_parse_tokens, METH_FASTCALL,
     "parse_tokens(raw, max_tokens, pairs) -> bytes: a msgpack array of token ids (of bigram "
     "pairs if `pairs`) as packed u32 little-endian; ValueError for anything else."},
    {"normalize_events", (PyCFunction)(void (*)(void))py_normalize_events, METH_FASTCALL,
     "normalize_events(events, removed_types, BlockRemoved, removal_tiers) -> (out, ignored): "
     "router.events._normalize_events_py in C."},
    {"decode_map_batch", (PyCFunction)(void (*)(void))py_decode_map_batch, METH_FASTCALL,
     "decode_map_batch(payload, spec, decode_event, run_type=None) -> EventBatch | None: a "
     "batch of map events, one-block removals (folded into run_type runs when given) and the "
     "usual BlockStored built in C."},
    {"cost_rows", (PyCFunction)(void (*)(void))py_cost_rows, METH_FASTCALL,
     "cost_rows(ranks, loads, any_tier, capacities, demands, helds, depths, tokens, block, "
     "blocks, per_token, per_request, lower, unseen, evict, fill) -> (costs, evicted, room): "
     "router/policy.py _cost_rows_py in C."},
    {"removal_run", (PyCFunction)(void (*)(void))py_removal_run, METH_FASTCALL,
     "removal_run(events, start, BlockRemoved) -> (end, hashes): "
     "router.index._removal_run_py in C."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "cachetree._speedups",
    "Compiled twins of cachetree.keys and the event decoder's token parsing.", -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    str_block_hashes = PyUnicode_InternFromString("block_hashes");
    str_medium = PyUnicode_InternFromString("medium");
    str_group_idx = PyUnicode_InternFromString("group_idx");
    str_locality = PyUnicode_InternFromString("locality");
    str_normalize = PyUnicode_InternFromString("normalize");
    str_tier = PyUnicode_InternFromString("tier");
    str_engine_hashes = PyUnicode_InternFromString("engine_hashes");
    str_uint32_code = PyUnicode_InternFromString("I");
    if (str_uint32_code == NULL || str_block_hashes == NULL || str_medium == NULL || str_group_idx == NULL
        || str_locality == NULL || str_normalize == NULL || str_tier == NULL
        || str_engine_hashes == NULL) {
        return NULL;
    }
    return PyModule_Create(&module_def);
}
