/*
 * cachetree._tables: the block index's tables in C (optional; twin: dicts and msgspec Nodes).
 *
 * Theory of operation
 * -------------------
 * At millions of blocks the index was mostly Python objects: a dict entry and a 64-bit int
 * key per block, a per-rank dict entry and an int engine hash per (rank, block) pair, and a
 * 64-byte node; ~360 bytes a block in RSS, where the node's own information is ~30 bytes.
 * This module keeps the same shapes with native words:
 *
 * - `Node`: the node of cachetree/tree.py with the same five attributes (parent, mask,
 *   children, tiers, ehash) and the same constructor, 48 bytes. parent, mask, children and a
 *   shared engine hash are native; what is rare (a tiers dict, a per-carrier engine-hash dict,
 *   a mask past 64 ranks, an engine hash outside u64) lives in a side record that exists only
 *   on the nodes that need it. Reading an attribute makes an int; writing one stores a word.
 *   `node.tiers` and a dict `node.ehash` are the very dicts the node holds, so code that edits
 *   them in place behaves as with the msgspec node. Not tracked by the cyclic collector.
 * - `NodeMap` (u64 key -> Node) and `HashMap` (u64 engine hash -> u64 key): insertion-ordered
 *   maps with the subset of dict's API the tree uses (get, [], in, del, setdefault, pop,
 *   popitem, len, iteration over keys/values/items in insertion order). The layout is
 *   CPython's compact dict's: a dense array of (key, value) entries in insertion order and a
 *   table of 32-bit entry numbers probed by the key's hash, so an entry is 16 bytes and a slot
 *   4 bytes, with no int object per key. Insertion order keeps the tree's parent-before-child
 *   rule, which snapshot export relies on, and popitem's newest-first order, which a sliced
 *   rank clear relies on. A deletion leaves a dead entry and a dummy slot; both go at the
 *   next rebuild (when the entries run out), which sizes the table to 2.25x the live entries:
 *   the table grows, keeps its size (a map at a steady size), or shrinks after mass removals.
 *   A rebuild goes in steps, each insertion moving a few entries into the new table (see
 *   "Rebuilding without a stall"): no insertion pays for millions of keys at once, which
 *   would stand the replica's event loop still. Keys are hashed with a per-process random seed
 *   (murmur3's finalizer over key ^ seed), so crafted keys cannot aim at one probe chain.
 *   Iterators refuse to go on after the map changed shape (RuntimeError), as dict's do.
 * - `place_run` and `remove_run`: cachetree/tree.py `_place_run_py` and `_remove_run_py` over
 *   these types, with native words end to end; they stop, having changed nothing for it,
 *   before the first block that needs the general path, which the Python caller handles.
 *
 * Everything here is held to the pure layout by tests (tests/unit/test_tables.py: the maps
 * against dict and the node against the msgspec node under random operations;
 * tests/unit/test_tree_twins.py: whole trees).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

static uint64_t seed;

static inline uint64_t
mix(uint64_t k)
{
    k ^= seed;
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

/* A u64 from an int; 0 with no error when `obj` is not an int in [0, 2**64). */
static inline int
as_u64(PyObject *obj, uint64_t *out)
{
    if (!PyLong_Check(obj)) {
        return 0;
    }
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    /* An exact int read from its digits: PyLong_AsUnsignedLongLong takes a general byte-wise
     * path for any int of more than one digit, which every 64-bit hash is (a fifth of a
     * stored chain's cost in C). The layout changed in 3.12: there, the general path. */
    if (PyLong_CheckExact(obj)) {
        Py_ssize_t size = Py_SIZE(obj);
        const digit *d = ((PyLongObject *)obj)->ob_digit;
        if (size < 0 || size > 3 || (size == 3 && d[2] >> 4)) {
            return 0; /* negative, or 2**64 and more */
        }
        uint64_t v = 0;
        for (Py_ssize_t i = size - 1; i >= 0; i--) {
            v = (v << PyLong_SHIFT) | d[i];
        }
        *out = v;
        return 1;
    }
#endif
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

/* ---- Node ------------------------------------------------------------------------------ */

#define F_PARENT 1u /* `parent` holds a key (else None) */
#define F_EHASH 2u  /* `u.ehash` holds the engine hash (else None); only without F_EXTRA */
#define F_EXTRA 4u  /* `u.extra` holds the side record (and the engine hash) */

typedef struct {
    PyObject *tiers; /* dict rank index -> tier bits, or NULL for None */
    PyObject *ehash; /* int or dict rank index -> engine hash, or NULL for None */
    PyObject *mask;  /* a mask that is not a u64, or NULL: the native one holds */
} Extra;

typedef struct {
    PyObject_HEAD
    uint64_t parent;
    uint64_t mask;
    union {
        uint64_t ehash;
        Extra *extra;
    } u;
    uint32_t children;
    uint32_t flags;
} NodeObject;

static PyTypeObject NodeType;

static inline Extra *
extra_of(NodeObject *n)
{
    return (n->flags & F_EXTRA) ? n->u.extra : NULL;
}

/* The tiers dict (borrowed) or NULL. */
static inline PyObject *
node_tiers(NodeObject *n)
{
    Extra *x = extra_of(n);
    return x ? x->tiers : NULL;
}

/* True when the mask is a native word (the runs' precondition). */
static inline int
native_mask(NodeObject *n)
{
    Extra *x = extra_of(n);
    return x == NULL || x->mask == NULL;
}

static Extra *
make_extra(NodeObject *n)
{
    if (n->flags & F_EXTRA) {
        return n->u.extra;
    }
    Extra *x = PyMem_Calloc(1, sizeof(Extra));
    if (x == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (n->flags & F_EHASH) {
        x->ehash = PyLong_FromUnsignedLongLong(n->u.ehash);
        if (x->ehash == NULL) {
            PyMem_Free(x);
            return NULL;
        }
    }
    n->u.extra = x;
    n->flags = (n->flags & ~F_EHASH) | F_EXTRA;
    return x;
}

/* Back to the native layout when the side record holds nothing a word cannot. */
static void
compact(NodeObject *n)
{
    Extra *x = extra_of(n);
    if (x == NULL || x->tiers != NULL || x->mask != NULL) {
        return;
    }
    uint64_t eh = 0;
    if (x->ehash != NULL && !(PyLong_CheckExact(x->ehash) && as_u64(x->ehash, &eh))) {
        return;
    }
    int had = x->ehash != NULL;
    Py_XDECREF(x->ehash);
    PyMem_Free(x);
    n->flags &= ~F_EXTRA;
    n->u.ehash = eh;
    if (had) {
        n->flags |= F_EHASH;
    }
}

static void
node_dealloc(NodeObject *n)
{
    Extra *x = extra_of(n);
    if (x != NULL) {
        Py_XDECREF(x->tiers);
        Py_XDECREF(x->ehash);
        Py_XDECREF(x->mask);
        PyMem_Free(x);
    }
    Py_TYPE(n)->tp_free((PyObject *)n);
}

static int
set_parent(NodeObject *n, PyObject *v)
{
    uint64_t key;
    if (v == Py_None) {
        n->flags &= ~F_PARENT;
        return 0;
    }
    if (!as_u64(v, &key)) {
        PyErr_Format(PyExc_TypeError, "Node.parent is a u64 key or None, not %R", v);
        return -1;
    }
    n->parent = key;
    n->flags |= F_PARENT;
    return 0;
}

static int
set_mask(NodeObject *n, PyObject *v)
{
    uint64_t mask;
    if (as_u64(v, &mask)) {
        Extra *x = extra_of(n);
        if (x != NULL && x->mask != NULL) {
            Py_CLEAR(x->mask);
            compact(n);
        }
        n->mask = mask;
        return 0;
    }
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "Node.mask is an int, not %R", v);
        return -1;
    }
    Extra *x = make_extra(n);
    if (x == NULL) {
        return -1;
    }
    Py_INCREF(v);
    Py_XSETREF(x->mask, v);
    n->mask = 0;
    return 0;
}

static int
set_children(NodeObject *n, PyObject *v)
{
    uint64_t c;
    if (!as_u64(v, &c) || c > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "Node.children is an int in [0, 2**32), not %R", v);
        return -1;
    }
    n->children = (uint32_t)c;
    return 0;
}

static int
set_tiers(NodeObject *n, PyObject *v)
{
    if (v == Py_None) {
        Extra *x = extra_of(n);
        if (x != NULL && x->tiers != NULL) {
            Py_CLEAR(x->tiers);
            compact(n);
        }
        return 0;
    }
    if (!PyDict_Check(v)) {
        PyErr_Format(PyExc_TypeError, "Node.tiers is a dict or None, not %R", v);
        return -1;
    }
    Extra *x = make_extra(n);
    if (x == NULL) {
        return -1;
    }
    Py_INCREF(v);
    Py_XSETREF(x->tiers, v);
    return 0;
}

static int
set_ehash(NodeObject *n, PyObject *v)
{
    uint64_t eh;
    Extra *x = extra_of(n);
    if (v == Py_None) {
        if (x != NULL) {
            Py_CLEAR(x->ehash);
            compact(n);
        }
        else {
            n->flags &= ~F_EHASH;
        }
        return 0;
    }
    if (x == NULL && PyLong_CheckExact(v) && as_u64(v, &eh)) {
        n->u.ehash = eh;
        n->flags |= F_EHASH;
        return 0;
    }
    if (!PyLong_Check(v) && !PyDict_Check(v)) {
        PyErr_Format(PyExc_TypeError, "Node.ehash is an int, a dict or None, not %R", v);
        return -1;
    }
    x = make_extra(n);
    if (x == NULL) {
        return -1;
    }
    Py_INCREF(v);
    Py_XSETREF(x->ehash, v);
    compact(n);
    return 0;
}

/* The engine hash field as an object (new reference; None when unset). */
static PyObject *
get_ehash_obj(NodeObject *n)
{
    Extra *x = extra_of(n);
    if (x != NULL) {
        return Py_NewRef(x->ehash ? x->ehash : Py_None);
    }
    if (n->flags & F_EHASH) {
        return PyLong_FromUnsignedLongLong(n->u.ehash);
    }
    Py_RETURN_NONE;
}

enum { FIELD_PARENT, FIELD_MASK, FIELD_CHILDREN, FIELD_TIERS, FIELD_EHASH };

static PyObject *
node_get(NodeObject *n, void *closure)
{
    Extra *x = extra_of(n);
    switch ((int)(intptr_t)closure) {
    case FIELD_PARENT:
        if (!(n->flags & F_PARENT)) {
            Py_RETURN_NONE;
        }
        return PyLong_FromUnsignedLongLong(n->parent);
    case FIELD_MASK:
        if (x != NULL && x->mask != NULL) {
            return Py_NewRef(x->mask);
        }
        return PyLong_FromUnsignedLongLong(n->mask);
    case FIELD_CHILDREN:
        return PyLong_FromUnsignedLong(n->children);
    case FIELD_TIERS:
        return Py_NewRef(x != NULL && x->tiers != NULL ? x->tiers : Py_None);
    default:
        return get_ehash_obj(n);
    }
}

static int
node_set(NodeObject *n, PyObject *v, void *closure)
{
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "Node fields cannot be deleted");
        return -1;
    }
    switch ((int)(intptr_t)closure) {
    case FIELD_PARENT:
        return set_parent(n, v);
    case FIELD_MASK:
        return set_mask(n, v);
    case FIELD_CHILDREN:
        return set_children(n, v);
    case FIELD_TIERS:
        return set_tiers(n, v);
    default:
        return set_ehash(n, v);
    }
}

static PyGetSetDef node_getset[] = {
    {"parent", (getter)node_get, (setter)node_set, "parent key, or None for a chain root",
     (void *)FIELD_PARENT},
    {"mask", (getter)node_get, (setter)node_set, "bit i set: rank index i carries the block",
     (void *)FIELD_MASK},
    {"children", (getter)node_get, (setter)node_set, "child nodes", (void *)FIELD_CHILDREN},
    {"tiers", (getter)node_get, (setter)node_set,
     "rank index -> tier bits for carriers not DEVICE-only, or None", (void *)FIELD_TIERS},
    {"ehash", (getter)node_get, (setter)node_set,
     "one engine hash for all carriers, a dict by rank index, or None", (void *)FIELD_EHASH},
    {NULL},
};

static NodeObject *
new_node(void)
{
    NodeObject *n = PyObject_New(NodeObject, &NodeType);
    if (n != NULL) {
        n->parent = n->mask = n->u.ehash = 0;
        n->children = n->flags = 0;
    }
    return n;
}

static const char *const field_names[] = {"parent", "mask", "children", "tiers", "ehash"};

/* Node(parent, mask, children, tiers=None, ehash=None), as the msgspec node is called. */
static PyObject *
node_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *values[5] = {NULL, NULL, NULL, Py_None, Py_None};
    if (nargs > 5) {
        PyErr_SetString(PyExc_TypeError, "Node takes at most 5 arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        values[i] = args[i];
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int f = 0;
        while (f < 5 && PyUnicode_CompareWithASCIIString(name, field_names[f]) != 0) {
            f++;
        }
        if (f == 5 || f < nargs) {
            PyErr_Format(PyExc_TypeError, "Node: unexpected or repeated argument %R", name);
            return NULL;
        }
        values[f] = args[nargs + k];
    }
    for (int f = 0; f < 3; f++) {
        if (values[f] == NULL) {
            PyErr_Format(PyExc_TypeError, "Node: missing argument '%s'", field_names[f]);
            return NULL;
        }
    }
    NodeObject *n = new_node();
    if (n == NULL) {
        return NULL;
    }
    for (int f = 0; f < 5; f++) {
        if (node_set(n, values[f], (void *)(intptr_t)f) < 0) {
            Py_DECREF(n);
            return NULL;
        }
    }
    return (PyObject *)n;
}

static PyObject *
node_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *kwnames = NULL;
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    Py_ssize_t nkw = kwds ? PyDict_GET_SIZE(kwds) : 0;
    PyObject *stack[10];
    if (nargs + nkw > 10) {
        PyErr_SetString(PyExc_TypeError, "Node takes at most 5 arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        stack[i] = PyTuple_GET_ITEM(args, i);
    }
    if (nkw) {
        kwnames = PyTuple_New(nkw);
        if (kwnames == NULL) {
            return NULL;
        }
        Py_ssize_t pos = 0, k = 0;
        PyObject *name, *value;
        while (PyDict_Next(kwds, &pos, &name, &value)) {
            PyTuple_SET_ITEM(kwnames, k, Py_NewRef(name));
            stack[nargs + k++] = value;
        }
    }
    PyObject *out = node_vectorcall((PyObject *)type, stack, nargs, kwnames);
    Py_XDECREF(kwnames);
    return out;
}

static PyObject *
node_repr(NodeObject *n)
{
    PyObject *fields[5];
    for (int f = 0; f < 5; f++) {
        fields[f] = node_get(n, (void *)(intptr_t)f);
        if (fields[f] == NULL) {
            for (int g = 0; g < f; g++) {
                Py_DECREF(fields[g]);
            }
            return NULL;
        }
    }
    PyObject *out = PyUnicode_FromFormat("Node(parent=%R, mask=%R, children=%R, tiers=%R, ehash=%R)",
                                         fields[0], fields[1], fields[2], fields[3], fields[4]);
    for (int f = 0; f < 5; f++) {
        Py_DECREF(fields[f]);
    }
    return out;
}

static PyObject *
node_richcompare(PyObject *a, PyObject *b, int op)
{
    if ((op != Py_EQ && op != Py_NE) || !PyObject_TypeCheck(b, &NodeType)) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    int equal = 1;
    for (int f = 0; f < 5 && equal == 1; f++) {
        PyObject *x = node_get((NodeObject *)a, (void *)(intptr_t)f);
        PyObject *y = node_get((NodeObject *)b, (void *)(intptr_t)f);
        equal = (x && y) ? PyObject_RichCompareBool(x, y, Py_EQ) : -1;
        Py_XDECREF(x);
        Py_XDECREF(y);
    }
    if (equal < 0) {
        return NULL;
    }
    return PyBool_FromLong(op == Py_EQ ? equal : !equal);
}

static PyObject *
node_sizeof(NodeObject *n, PyObject *unused)
{
    return PyLong_FromSsize_t(sizeof(NodeObject) + (extra_of(n) ? sizeof(Extra) : 0));
}

static PyMethodDef node_methods[] = {
    {"__sizeof__", (PyCFunction)node_sizeof, METH_NOARGS, NULL},
    {NULL},
};

static PyTypeObject NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cachetree._tables.Node",
    .tp_basicsize = sizeof(NodeObject),
    .tp_dealloc = (destructor)node_dealloc,
    .tp_repr = (reprfunc)node_repr,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_richcompare = node_richcompare,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Node(parent, mask, children, tiers=None, ehash=None): a block of the index.",
    .tp_getset = node_getset,
    .tp_methods = node_methods,
    .tp_new = node_new,
    .tp_vectorcall = node_vectorcall,
};

/* ---- NodeMap and HashMap ------------------------------------------------------------- */

typedef struct {
    uint64_t key;
    uint64_t value; /* a u64 (HashMap), or a PyObject * (NodeMap) */
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *entries;       /* insertion order */
    uint8_t *live;        /* live[i]: entries[i] is in the map; 0 from n_entries on */
    int32_t *slots;       /* 0 empty, -1 dummy (deleted), i + 1: entries[i] */
    uint8_t *tags;        /* per slot: TAG_EMPTY, TAG_DUMMY, or tag_of(its key's mix) */
    Py_ssize_t size;      /* slots, a power of two */
    Py_ssize_t blocks_size; /* the slots `entries` and `live` are allocated for: `size`, but
                             * for a larger one's during a rebuild to a smaller table */
    Py_ssize_t usable;    /* entries, and slots filled, before the next rebuild: BUDGET(size) */
    Py_ssize_t n_entries; /* entries written, dead ones included */
    Py_ssize_t used;      /* live entries */
    Py_ssize_t filled;    /* slots not empty: live entries and dummies */
    /* A rebuild under way (see "Rebuilding without a stall"): the slots and tags of the table
     * before it, NULL when none is; the entries before `read` are in the new table, slid to
     * [0, written); the entries from `old_end` on were inserted during it. */
    int32_t *old_slots;
    uint8_t *old_tags;
    Py_ssize_t old_size;
    Py_ssize_t read;
    Py_ssize_t written;
    Py_ssize_t old_end;
    /* The table of the next rebuild, paged in ahead of it (see map_prepare); NULL when none. */
    int32_t *next_slots;
    Py_ssize_t next_size;
    Py_ssize_t next_touched; /* its bytes paged in */
    uint64_t version;     /* changes on every insertion of a key, deletion and rebuild */
    int objects;          /* NodeMap: values are objects */
} MapObject;

static PyTypeObject NodeMapType, HashMapType, MapIterType;

/* Each slot has a tag byte beside its entry number: empty, dummy, or 8 bits of the key's
 * hash. A probe compares tags and reads an entry only when they are equal (1 in 254 for
 * another key), and probes linearly (the key's hash is mixed, so runs stay short): a lookup
 * that passes occupied slots, as most do in a table filled to 2/3, stays in one cache line of
 * the tag array (64 slots) instead of missing the cache on every slot and entry it passes. */
#define TAG_EMPTY 0
#define TAG_DUMMY 1

static inline uint8_t
tag_of(uint64_t h)
{
    uint8_t t = (uint8_t)(h >> 56);
    return t < 2 ? (uint8_t)(t + 2) : t;
}

#define MIN_SIZE 8
#define MAX_SIZE ((Py_ssize_t)1 << 31)

/* The entries a table of `size` slots has room for, and its budget: the entries (and slots
 * filled) at which a rebuild starts, 1/32 short of them, so that the insertions made while
 * the rebuild runs (one in REHASH_STEP - 1 of the entries it reads) have room in the same
 * blocks (see "Rebuilding without a stall"). */
#define ROOM(size) ((size) * 2 / 3)
#define BUDGET(size) (ROOM(size) - ROOM(size) / 32 - 1)

/* A map's arrays are three zeroed blocks: its entries, their live bytes, and its table (the
 * slots' words, then their tags), each sized by the map's slots. A map of HUGE_MIN or more has
 * its blocks on transparent huge pages: a lookup in a table of tens of MB is, beside its cache
 * misses, a TLB miss on 4 KiB pages, and a page walk is several more memory reads (more under
 * a hypervisor's nested paging); 2 MiB pages make those rare. Only from HUGE_MIN, so rounding
 * the blocks to whole huge pages wastes little of the map. A smaller block of MAP_MIN or more
 * is a plain mapping of its own. Either way a growth moves the entries and live bytes to their
 * larger blocks by remapping their pages (mremap) instead of copying them, and a shrinking
 * gives the pages past the smaller blocks back (munmap). Elsewhere than Linux, calloc and
 * copies. */
#define MAP_MIN ((size_t)1 << 20)
#define HUGE_PAGE ((size_t)2 << 20)
#define HUGE_MIN ((size_t)16 << 20)

#if defined(__linux__) && defined(MADV_HUGEPAGE) && defined(MREMAP_FIXED)
#define OWN_MAPPINGS 1
#endif

enum { ENTRIES, LIVE, INDEX };

static inline size_t
index_bytes(Py_ssize_t size)
{
    return (size_t)size * (sizeof(int32_t) + 1);
}

/* The bytes of block `which` of a map of `size` slots. */
static inline size_t
block_bytes(int which, Py_ssize_t size)
{
    const size_t room = (size_t)ROOM(size);
    return which == ENTRIES ? room * sizeof(Entry) : which == LIVE ? room : index_bytes(size);
}

#ifdef OWN_MAPPINGS
static inline int
on_huge_pages(Py_ssize_t size)
{
    return block_bytes(ENTRIES, size) + block_bytes(LIVE, size) + index_bytes(size) >= HUGE_MIN;
}
#endif

/* The length of the mapping of block `which` of a map of `size` slots, or 0 on the heap. */
static inline size_t
mapped_len(int which, Py_ssize_t size)
{
    const size_t bytes = block_bytes(which, size);
#ifdef OWN_MAPPINGS
    if (on_huge_pages(size)) {
        return (bytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    }
    if (bytes >= MAP_MIN) {
        return bytes;
    }
#else
    (void)bytes;
#endif
    return 0;
}

static void *
table_alloc(int which, Py_ssize_t size)
{
#ifdef OWN_MAPPINGS
    const size_t len = mapped_len(which, size);
    if (on_huge_pages(size)) {
        /* Mapped one huge page larger, then trimmed to a huge-page boundary at both ends. */
        uint8_t *raw = mmap(NULL, len + HUGE_PAGE, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw == MAP_FAILED) {
            return NULL;
        }
        uint8_t *p = (uint8_t *)(((uintptr_t)raw + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
        if (p > raw) {
            munmap(raw, (size_t)(p - raw));
        }
        if (p + len < raw + len + HUGE_PAGE) {
            munmap(p + len, (size_t)(raw + len + HUGE_PAGE - (p + len)));
        }
        (void)madvise(p, len, MADV_HUGEPAGE); /* a hint: without THP, 4 KiB pages */
        return p;
    }
    if (len > 0) {
        void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
#endif
    return PyMem_RawCalloc(block_bytes(which, size), 1);
}

static void
table_free(void *p, int which, Py_ssize_t size)
{
    if (p == NULL) {
        return;
    }
#ifdef OWN_MAPPINGS
    const size_t len = mapped_len(which, size);
    if (len > 0) {
        munmap(p, len);
        return;
    }
#endif
    PyMem_RawFree(p);
}

/* The first `used` bytes of block `which` of `old_size` slots, `src`, into the one of
 * `new_size` (more) slots, `dst`; `src` is gone after. Two mappings: the pages move (`dst` has
 * room for all of `src`'s, at the same or a coarser alignment), which costs page-table
 * updates, not copies. */
static void
table_move(void *dst, void *src, int which, Py_ssize_t new_size, Py_ssize_t old_size,
           size_t used)
{
    if (src == NULL) {
        return;
    }
#ifdef OWN_MAPPINGS
    const size_t len = mapped_len(which, old_size);
    if (len > 0 && mapped_len(which, new_size) > 0
        && mremap(src, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, dst) != MAP_FAILED) {
        return;
    }
#else
    (void)new_size;
#endif
    memcpy(dst, src, used);
    table_free(src, which, old_size);
}

/* Can block `which` of `old_size` slots keep its pages as the one of `new_size` (fewer)? Where
 * both are mappings: see table_trim. */
static inline int
table_trims_in_place(int which, Py_ssize_t new_size, Py_ssize_t old_size)
{
#ifdef OWN_MAPPINGS
    return mapped_len(which, old_size) > 0 && mapped_len(which, new_size) > 0;
#else
    (void)which, (void)new_size, (void)old_size;
    return 0;
#endif
}

/* Block `which` of `old_size` slots, `p`, made the one of `new_size` (fewer) slots where
 * table_trims_in_place: the pages past the smaller block are given back. */
static void
table_trim(void *p, int which, Py_ssize_t new_size, Py_ssize_t old_size)
{
#ifdef OWN_MAPPINGS
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t keep = (mapped_len(which, new_size) + page - 1) & ~(page - 1);
    const size_t len = mapped_len(which, old_size);
    if (keep < len) {
        munmap((uint8_t *)p + keep, len - keep);
    }
#else
    (void)p, (void)which, (void)new_size, (void)old_size;
#endif
}

/* A table of `size` slots: its slots' words, then its tags, zeroed. */
static int
index_alloc(Py_ssize_t size, int32_t **slots, uint8_t **tags)
{
    *slots = table_alloc(INDEX, size);
    if (*slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *tags = (uint8_t *)(*slots + size);
    return 0;
}

/* Fresh blocks for `size` slots into `m`; `m` unchanged on failure. */
static int
map_alloc(MapObject *m, Py_ssize_t size)
{
    Entry *entries = table_alloc(ENTRIES, size);
    uint8_t *live = table_alloc(LIVE, size);
    int32_t *slots = NULL;
    uint8_t *tags = NULL;
    if (entries == NULL || live == NULL || index_alloc(size, &slots, &tags) < 0) {
        table_free(entries, ENTRIES, size);
        table_free(live, LIVE, size);
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        return -1;
    }
    m->entries = entries;
    m->live = live;
    m->slots = slots;
    m->tags = tags;
    m->size = m->blocks_size = size;
    m->usable = BUDGET(size);
    return 0;
}

/* Free the blocks of `m` (not its values), the table of a rebuild under way included. */
static void
map_free_blocks(const MapObject *m)
{
    table_free(m->entries, ENTRIES, m->blocks_size);
    table_free(m->live, LIVE, m->blocks_size);
    table_free(m->slots, INDEX, m->size);
    table_free(m->old_slots, INDEX, m->old_size);
    table_free(m->next_slots, INDEX, m->next_size);
}

/* Free the table paged in for a rebuild that will not come as prepared. */
static void
map_drop_next(MapObject *m)
{
    table_free(m->next_slots, INDEX, m->next_size);
    m->next_slots = NULL;
    m->next_size = m->next_touched = 0;
}

/* Entry number of `key` (mixed: `h`) in one table, or -1. `*slot` gets the slot holding it,
 * or (absent) the slot a new entry for it goes in: the first dummy on its probe chain, else the
 * empty slot ending it. */
static inline Py_ssize_t
table_find(const Entry *entries, const int32_t *slots, const uint8_t *tags, Py_ssize_t size,
           uint64_t h, uint64_t key, Py_ssize_t *slot)
{
    size_t mask = (size_t)size - 1;
    size_t i = (size_t)h & mask;
    const uint8_t tag = tag_of(h);
    Py_ssize_t free_slot = -1;
    for (;;) {
        uint8_t t = tags[i];
        if (t == tag) {
            int32_t ix = slots[i];
            if (entries[ix - 1].key == key) {
                *slot = (Py_ssize_t)i;
                return ix - 1;
            }
        }
        else if (t == TAG_EMPTY) {
            *slot = free_slot >= 0 ? free_slot : (Py_ssize_t)i;
            return -1;
        }
        else if (t == TAG_DUMMY && free_slot < 0) {
            free_slot = (Py_ssize_t)i;
        }
        i = (i + 1) & mask;
    }
}

/* Rebuilding without a stall
 * --------------------------
 * A map is rebuilt when its entries run out, or its slots fill with dummies: the live entries
 * slide to the front of the entries, in order, dropping the dead ones, and are placed in a
 * fresh table sized for them, larger (a growth), the same (a map at a steady size: every
 * insertion meets a deletion) or smaller (after mass removals). At millions of keys, placing
 * them all at once takes tens to hundreds of ms in which the replica's event loop stands still,
 * so the map does it in steps. map_rebuild_for starts an empty table of the new size beside the
 * old one (for a growth, the entries and live bytes first move to larger blocks: their pages,
 * not their bytes). From then on every insertion goes to the new table and then reads the next
 * REHASH_STEP entries, from `read` on: each live one slides down to `written` and is placed in
 * the new table under that number (an entry inserted during the rebuild is there already: only
 * its slot's number changes). Entries from `read` on have not moved, so the old table, whose
 * slots hold the entries' numbers from before the rebuild, still finds them; an old slot whose
 * number is below `read` names an entry that moved, so a lookup tries the new table, then the
 * old one, and takes an old slot's answer only from `read` on. Entries stay in insertion
 * order throughout (slid entries, then dead ones, then the ones not read yet), so iteration
 * and popitem need nothing of their own. Deletions and lookups move nothing, so a slot number
 * that map_find gave stays good until the map's next insertion, as before.
 *
 * A rebuild reads the n entries it started with and the insertions made while it runs, at
 * REHASH_STEP - 1 more than are inserted: it ends after n / (REHASH_STEP - 1) insertions. Those
 * need room: a rebuild starts when a table's entries or slots reach its budget (`usable`),
 * 1/32 short of its entries (see BUDGET), and sizes the new table for them too (rebuild_room).
 * The old table is freed when the last entry is read; a rebuild to a smaller table then
 * gives the larger blocks' pages beyond the smaller ones back. */
#define REHASH_STEP 64

/* map_find when the key is in no slot of the new table and a rebuild is under way: the old
 * table's slot of it, given as m->size + its number, or -1 with `*slot` left as the new
 * table's. Out of line (and the key mixed again), to keep the common path's registers. */
static Py_NO_INLINE Py_ssize_t
map_find_old(const MapObject *m, uint64_t key, Py_ssize_t *slot)
{
    Py_ssize_t old_slot, ix = table_find(m->entries, m->old_slots, m->old_tags, m->old_size,
                                         mix(key), key, &old_slot);
    if (ix < m->read) {
        return -1; /* not there, or moved (then the new table has it, or it was deleted since) */
    }
    *slot = m->size + old_slot;
    return ix;
}

/* Entry number of `key` (mixed: `h`), or -1. `*slot` gets the slot holding it (a number past
 * m->size: the old table's, during a rebuild), or (absent) the slot of the table a new entry
 * goes in. */
static inline Py_ssize_t
map_find_mixed(const MapObject *m, uint64_t key, uint64_t h, Py_ssize_t *slot)
{
    Py_ssize_t ix = table_find(m->entries, m->slots, m->tags, m->size, h, key, slot);
    if (ix < 0 && m->old_tags != NULL) {
        return map_find_old(m, key, slot);
    }
    return ix;
}

/* map_find_mixed, `key` mixed here. */
static inline Py_ssize_t
map_find(const MapObject *m, uint64_t key, Py_ssize_t *slot)
{
    return map_find_mixed(m, key, mix(key), slot);
}

/* Prefetching. On an index of a few hundred thousand blocks the tables are far larger than
 * the CPU caches, so each lookup of a run (a stored chain, a removed chain, a prompt's path)
 * is two or three cache misses, one after the other. The keys of a run are known up front,
 * so the loops below ask for the memory of lookup i + PREFETCH_AHEAD while doing lookup i:
 * the misses overlap instead of adding up. A prefetch is only a hint, so a guess that a
 * collision or a rebuild makes wrong costs nothing but the hint. */
#define PREFETCH_AHEAD 4

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(addr) __builtin_prefetch(addr)
#else
#define PREFETCH(addr) ((void)(addr))
#endif

/* The slot a key mixed to `h` probes first (and during a rebuild, the old table's: a key absent
 * from the new table is looked up there too). */
static inline void
map_prefetch_mixed(const MapObject *m, uint64_t h)
{
    size_t i = h & ((size_t)m->size - 1);
    PREFETCH(&m->tags[i]);
    PREFETCH(&m->slots[i]);
    if (m->old_tags != NULL) {
        i = h & ((size_t)m->old_size - 1);
        PREFETCH(&m->old_tags[i]);
        PREFETCH(&m->old_slots[i]);
    }
}

/* The entry in the first slot of a key mixed to `h`, or NULL (empty, a dummy): read after
 * map_prefetch_mixed had time to land, it is a guess at where the key lives (a collision makes
 * it another key's). */
static inline const Entry *
map_peek(const MapObject *m, uint64_t h)
{
    size_t i = h & ((size_t)m->size - 1);
    return m->tags[i] == tag_of(h) ? &m->entries[m->slots[i] - 1] : NULL;
}

/* The entry `key` (mixed: `h`) lives in, when its first slot has it (a guess: see above). */
static inline const Entry *
map_peek_found(const MapObject *m, uint64_t key, uint64_t h)
{
    const Entry *e = map_peek(m, h);
    return e != NULL && e->key == key ? e : NULL;
}

/* The prefetch stages of a run of lookups of the keys `ks[0:n]` in `m` (mixed: `hs[0:n]`, or
 * NULL to mix them here), the run at key i:
 * key i + 3 * PREFETCH_AHEAD gets its slot fetched, key i + 2 * PREFETCH_AHEAD its entry (its
 * slot has landed by then), key i + PREFETCH_AHEAD the object its entry points to (a
 * NodeMap's node). i may be negative (the stages of a run's first keys, before its loop). */
static inline void
map_prefetch_run_mixed(const MapObject *m, const uint64_t *ks, const uint64_t *hs, Py_ssize_t i,
                       Py_ssize_t n)
{
    const Py_ssize_t a = PREFETCH_AHEAD;
    const Entry *e;
    Py_ssize_t j = i + 3 * a;
    if (j >= 0 && j < n) {
        map_prefetch_mixed(m, hs != NULL ? hs[j] : mix(ks[j]));
    }
    j -= a;
    if (j >= 0 && j < n && (e = map_peek(m, hs != NULL ? hs[j] : mix(ks[j]))) != NULL) {
        PREFETCH(e);
    }
    j -= a;
    if (m->objects && j >= 0 && j < n &&
        (e = map_peek_found(m, ks[j], hs != NULL ? hs[j] : mix(ks[j]))) != NULL) {
        PREFETCH((const void *)(uintptr_t)e->value);
    }
}

/* map_prefetch_run_mixed with the keys mixed as they are read. */
static inline void
map_prefetch_run(const MapObject *m, const uint64_t *ks, Py_ssize_t i, Py_ssize_t n)
{
    map_prefetch_run_mixed(m, ks, NULL, i, n);
}

/* The stages for every key before the first's own: called before a run's loop. */
static inline void
map_prefetch_start_mixed(const MapObject *m, const uint64_t *ks, const uint64_t *hs, Py_ssize_t n)
{
    if (m->slots == NULL) {
        return;
    }
    for (Py_ssize_t p = -3 * PREFETCH_AHEAD; p < 0; p++) {
        map_prefetch_run_mixed(m, ks, hs, p, n);
    }
}

static inline void
map_prefetch_start(const MapObject *m, const uint64_t *ks, Py_ssize_t n)
{
    map_prefetch_start_mixed(m, ks, NULL, n);
}

/* A run's keys as u64s, converted once (prefetching reads each several times): on the stack
 * for a run of up to U64_LOCAL, else on the heap. */
#define U64_LOCAL 256

typedef struct {
    uint64_t *v;
    uint64_t local[U64_LOCAL];
} U64Run;

/* The u64s of items[0:n] into run->v, up to the first that is not a u64 int: how many, or -1
 * (no memory, error set). */
static Py_ssize_t
u64_run(U64Run *run, PyObject *const *items, Py_ssize_t n)
{
    run->v = n <= U64_LOCAL ? run->local : PyMem_Malloc((size_t)n * sizeof(uint64_t));
    if (run->v == NULL) {
        run->v = run->local;
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t k = 0;
    while (k < n && as_u64(items[k], &run->v[k])) {
        k++;
    }
    return k;
}

static void
u64_run_free(U64Run *run)
{
    if (run->v != run->local) {
        PyMem_Free(run->v);
    }
}

/* The entries and live bytes into blocks for the table's slots, after a rebuild to a smaller
 * table: a mapping keeps its pages up to the smaller length, another block is copied (into
 * one on the heap: under MAP_MIN, a quick copy). Left as they are when there is no memory for
 * a copy. */
static void
map_shrink_blocks(MapObject *m)
{
    void *blocks[2] = {m->entries, m->live};
    const size_t used[2] = {(size_t)m->n_entries * sizeof(Entry), (size_t)m->n_entries};
    void *copies[2] = {NULL, NULL};
    for (int which = ENTRIES; which <= LIVE; which++) {
        if (!table_trims_in_place(which, m->size, m->blocks_size)
            && (copies[which] = table_alloc(which, m->size)) == NULL) {
            table_free(copies[ENTRIES], ENTRIES, m->size);
            return;
        }
    }
    for (int which = ENTRIES; which <= LIVE; which++) {
        if (copies[which] != NULL) {
            memcpy(copies[which], blocks[which], used[which]);
            table_free(blocks[which], which, m->blocks_size);
            blocks[which] = copies[which];
        }
        else {
            table_trim(blocks[which], which, m->size, m->blocks_size);
        }
    }
    m->entries = blocks[ENTRIES];
    m->live = blocks[LIVE];
    m->blocks_size = m->size;
}

/* The end of the rebuild under way: the entries past `written` are dead (moved down, or
 * deleted), the old table goes. */
static void
map_rebuild_done(MapObject *m)
{
    table_free(m->old_slots, INDEX, m->old_size);
    m->old_slots = NULL;
    m->old_tags = NULL;
    m->old_size = 0;
    if (m->n_entries > m->written) {
        m->n_entries = m->written;
    }
    m->read = m->written = m->old_end = 0;
    while (m->n_entries > 0 && !m->live[m->n_entries - 1]) {
        m->n_entries--; /* moved, then deleted */
    }
    if (m->blocks_size > m->size) {
        map_shrink_blocks(m);
    }
}

/* The dead entries at the end go: the newest entries' room is reused at once (popitem, churn).
 * A rebuild under way that has no live entry left to read is done. */
static void
map_trim(MapObject *m)
{
    while (m->n_entries > 0 && !m->live[m->n_entries - 1]) {
        m->n_entries--;
    }
    if (m->old_tags != NULL) {
        if (m->n_entries <= m->read) {
            map_rebuild_done(m);
        }
        else if (m->n_entries < m->old_end) {
            m->old_end = m->n_entries; /* the entries written from there on are insertions */
        }
    }
}

/* The rebuild's next REHASH_STEP entries read (see "Rebuilding without a stall"): each live one
 * slid down to `written` and placed in the new table under that number; the rebuild done once
 * all are. */
static void
map_migrate(MapObject *m)
{
    const Py_ssize_t first = m->read;
    const Py_ssize_t n = m->n_entries - first < REHASH_STEP ? m->n_entries - first : REHASH_STEP;
    const size_t mask = (size_t)m->size - 1;
    /* The entries are read in order; their slots in the new table are cache misses far apart:
     * asked for all at once, they overlap. */
    uint64_t hs[REHASH_STEP];
    for (Py_ssize_t c = 0; c < n; c++) {
        if (m->live[first + c]) {
            hs[c] = mix(m->entries[first + c].key);
            PREFETCH(&m->tags[hs[c] & mask]);
            PREFETCH(&m->slots[hs[c] & mask]);
        }
    }
    Py_ssize_t w = m->written;
    for (Py_ssize_t c = 0; c < n; c++) {
        const Py_ssize_t j = first + c;
        if (!m->live[j]) {
            continue;
        }
        size_t i = (size_t)hs[c] & mask;
        if (j < m->old_end) {
            while (m->tags[i] > TAG_DUMMY) {
                i = (i + 1) & mask; /* a dummy may take it: the key is in no slot of this table */
            }
            m->filled += m->tags[i] == TAG_EMPTY;
            m->tags[i] = tag_of(hs[c]);
        }
        else if (w == j) {
            w++; /* inserted during the rebuild, with no dead entry before it: it stays */
            continue;
        }
        else {
            while (m->slots[i] != (int32_t)(j + 1)) {
                i = (i + 1) & mask; /* its slot, as it was inserted during the rebuild */
            }
        }
        m->slots[i] = (int32_t)(w + 1);
        if (w != j) {
            m->entries[w] = m->entries[j];
            m->live[w] = 1;
            m->live[j] = 0;
        }
        w++;
    }
    m->written = w;
    m->read = first + n;
    if (m->read == m->n_entries) {
        map_rebuild_done(m);
    }
}

/* The rest of a rebuild under way, at once. */
static void
map_migrate_all(MapObject *m)
{
    while (m->old_tags != NULL) {
        map_migrate(m);
    }
}

/* The room a rebuild starting now makes: half as many again as are live, and at least what
 * the insertions made while it runs take (see "Rebuilding without a stall"). */
static inline Py_ssize_t
rebuild_room(const MapObject *m)
{
    const Py_ssize_t during = m->n_entries / (REHASH_STEP - 1) + 1;
    return m->used + (m->used / 2 > during ? m->used / 2 : during) + 1;
}

/* The slots of the smallest table whose budget is above `room`; 0 past MAX_SIZE. */
static Py_ssize_t
size_for(Py_ssize_t room)
{
    Py_ssize_t size = MIN_SIZE;
    while (BUDGET(size) <= room) {
        if (size >= MAX_SIZE) {
            return 0;
        }
        size <<= 1;
    }
    return size;
}

/* A new table's pages fault in as keys land in them. The keys a rebuild places land anywhere,
 * so with none of its pages in yet its first insertions would take every fault between them:
 * a huge page's fault can take tens of ms where the kernel compacts memory to find one. So
 * over the last eighth of the budget before a rebuild, each insertion pages in one more page
 * of the table it will use: an insertion takes one page fault at most. */
#define PAGE_STEP 4096

static void
map_prepare(MapObject *m)
{
    if (m->next_slots == NULL) {
        const Py_ssize_t size = size_for(rebuild_room(m));
        if (size == 0 || index_bytes(size) < MAP_MIN) {
            return; /* past MAX_SIZE, or a table calloc pages in when zeroing */
        }
        m->next_slots = table_alloc(INDEX, size);
        if (m->next_slots == NULL) {
            return; /* the rebuild allocates it, or says there is no memory */
        }
        m->next_size = size;
        m->next_touched = 0;
    }
    if (m->next_touched < (Py_ssize_t)index_bytes(m->next_size)) {
        ((volatile uint8_t *)m->next_slots)[m->next_touched] = 0;
        m->next_touched += PAGE_STEP;
    }
}

/* An insertion's share of a rebuild under way, or of paging in the next one's table (the last
 * eighth of the budget). Out of line: most insertions take neither. */
static Py_NO_INLINE void
map_after_insert(MapObject *m)
{
    if (m->old_tags != NULL) {
        map_migrate(m);
    }
    else {
        map_prepare(m);
    }
}

/* Start a rebuild with room for `room` live entries (see "Rebuilding without a stall"); `m`
 * unchanged on failure but for the table paged in ahead, which goes. No rebuild is under way. */
static int
map_rebuild_for(MapObject *m, Py_ssize_t room)
{
    const Py_ssize_t size = size_for(room);
    int32_t *slots = NULL;
    uint8_t *tags = NULL;
    if (size > 0 && m->next_slots != NULL && m->next_size == size) {
        slots = m->next_slots;
        tags = (uint8_t *)(slots + size);
        m->next_slots = NULL;
        m->next_size = m->next_touched = 0;
    }
    map_drop_next(m);
    if (size == 0) {
        PyErr_SetString(PyExc_MemoryError, "map past 2**31 slots");
        return -1;
    }
    if (slots == NULL && index_alloc(size, &slots, &tags) < 0) {
        return -1;
    }
    if (size > m->blocks_size) {
        Entry *entries = table_alloc(ENTRIES, size);
        uint8_t *live = table_alloc(LIVE, size);
        if (entries == NULL || live == NULL) {
            table_free(slots, INDEX, size);
            table_free(entries, ENTRIES, size);
            table_free(live, LIVE, size);
            PyErr_NoMemory();
            return -1;
        }
        table_move(entries, m->entries, ENTRIES, size, m->blocks_size,
                   (size_t)m->n_entries * sizeof(Entry));
        table_move(live, m->live, LIVE, size, m->blocks_size, (size_t)m->n_entries);
        m->entries = entries;
        m->live = live;
        m->blocks_size = size;
    }
    m->old_slots = m->slots;
    m->old_tags = m->tags;
    m->old_size = m->size;
    m->read = m->written = 0;
    m->old_end = m->n_entries;
    m->slots = slots;
    m->tags = tags;
    m->size = size;
    m->usable = BUDGET(size);
    m->filled = 0;
    m->version++;
    return 0;
}

/* When the entries or the slots filled reach the budget: a rebuild. */
static int
map_make_room(MapObject *m)
{
    if (m->old_tags != NULL) {
        /* Not reached while the budget leaves the rebuild's insertions room: a safeguard. */
        map_migrate_all(m);
    }
    return map_rebuild_for(m, rebuild_room(m));
}

/* Insert a key known to be absent (`slot` from map_find), mixed: `h`; the value is stolen on
 * success. */
static int
map_insert_mixed(MapObject *m, uint64_t key, uint64_t h, uint64_t value, Py_ssize_t slot)
{
    /* Dummies count: a table with no empty slot left would never end a probe. During a
     * rebuild, the new table has room for what comes (rebuild_room): only the blocks' end
     * counts. */
    if (m->old_tags == NULL ? m->n_entries >= m->usable || m->filled >= m->usable
                            : m->n_entries >= ROOM(m->blocks_size)) {
        if (map_make_room(m) < 0) {
            return -1;
        }
        if (map_find(m, key, &slot) >= 0) {
            PyErr_SetString(PyExc_SystemError, "map: a key appeared during a rebuild");
            return -1;
        }
    }
    Py_ssize_t n = m->n_entries++;
    m->entries[n].key = key;
    m->entries[n].value = value;
    m->live[n] = 1;
    if (m->tags[slot] == TAG_EMPTY) {
        m->filled++;
    }
    m->slots[slot] = (int32_t)(n + 1);
    m->tags[slot] = tag_of(h);
    m->used++;
    m->version++;
    const Py_ssize_t spent = m->n_entries > m->filled ? m->n_entries : m->filled;
    if (m->old_tags != NULL || spent >= m->usable - (m->usable >> 3)) {
        map_after_insert(m);
    }
    return 0;
}

/* map_insert_mixed, `key` mixed here. */
static inline int
map_insert_new(MapObject *m, uint64_t key, uint64_t value, Py_ssize_t slot)
{
    return map_insert_mixed(m, key, mix(key), value, slot);
}

/* Remove entry `ix` found at `slot`; returns its value (a reference, in a NodeMap). */
static uint64_t
map_delete_at(MapObject *m, Py_ssize_t ix, Py_ssize_t slot)
{
    uint64_t value = m->entries[ix].value;
    if (slot < m->size) {
        m->slots[slot] = -1;
        m->tags[slot] = TAG_DUMMY;
    }
    else {
        m->old_tags[slot - m->size] = TAG_DUMMY; /* its old slot, during a rebuild */
    }
    m->live[ix] = 0;
    m->used--;
    m->version++;
    map_trim(m);
    return value;
}

static inline PyObject *
box(const MapObject *m, uint64_t value)
{
    if (m->objects) {
        return Py_NewRef((PyObject *)(uintptr_t)value);
    }
    return PyLong_FromUnsignedLongLong(value);
}

static int
unbox(const MapObject *m, PyObject *v, uint64_t *out)
{
    if (m->objects) {
        *out = (uint64_t)(uintptr_t)Py_NewRef(v);
        return 0;
    }
    if (!as_u64(v, out)) {
        PyErr_Format(PyExc_TypeError, "%s values are ints in [0, 2**64), not %R",
                     Py_TYPE(m)->tp_name, v);
        return -1;
    }
    return 0;
}

static inline void
drop_value(const MapObject *m, uint64_t value)
{
    if (m->objects) {
        Py_DECREF((PyObject *)(uintptr_t)value);
    }
}

static int
key_for_insert(const MapObject *m, PyObject *key, uint64_t *out)
{
    if (!as_u64(key, out)) {
        PyErr_Format(PyExc_TypeError, "%s keys are ints in [0, 2**64), not %R",
                     Py_TYPE(m)->tp_name, key);
        return -1;
    }
    return 0;
}

static PyObject *
map_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_Format(PyExc_TypeError, "%s() takes no arguments", type->tp_name);
        return NULL;
    }
    MapObject *m = (MapObject *)type->tp_alloc(type, 0);
    if (m == NULL) {
        return NULL;
    }
    m->objects = PyType_IsSubtype(type, &NodeMapType);
    if (map_alloc(m, MIN_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

static void
map_clear_entries(MapObject *m)
{
    const MapObject held = *m; /* detached first: a value's deallocation may use the map */
    m->entries = NULL;
    m->live = NULL;
    m->slots = NULL;
    m->tags = NULL;
    m->old_slots = NULL;
    m->old_tags = NULL;
    m->next_slots = NULL;
    m->n_entries = m->used = m->filled = m->size = m->blocks_size = m->usable = 0;
    m->old_size = m->read = m->written = m->old_end = 0;
    m->next_size = m->next_touched = 0;
    m->version++;
    if (held.objects) {
        for (Py_ssize_t j = 0; j < held.n_entries; j++) {
            if (held.live[j]) {
                Py_DECREF((PyObject *)(uintptr_t)held.entries[j].value);
            }
        }
    }
    map_free_blocks(&held);
}

static void
map_dealloc(MapObject *m)
{
    map_clear_entries(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t
map_length(MapObject *m)
{
    return m->used;
}

/* Entry number of `key` for a lookup: -1 when absent or when `key` is no u64 int (as a dict
 * holds no such key). */
static inline Py_ssize_t
lookup(const MapObject *m, PyObject *key, Py_ssize_t *slot)
{
    uint64_t k;
    if (m->slots == NULL || !as_u64(key, &k)) {
        return -1;
    }
    return map_find(m, k, slot);
}

static int
map_contains(MapObject *m, PyObject *key)
{
    Py_ssize_t slot;
    return lookup(m, key, &slot) >= 0;
}

static PyObject *
map_subscript(MapObject *m, PyObject *key)
{
    Py_ssize_t slot, ix = lookup(m, key, &slot);
    if (ix < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return box(m, m->entries[ix].value);
}

static int
ensure_table(MapObject *m)
{
    return m->slots == NULL ? map_alloc(m, MIN_SIZE) : 0;
}

static int
map_ass_subscript(MapObject *m, PyObject *key, PyObject *v)
{
    Py_ssize_t slot;
    if (v == NULL) {
        Py_ssize_t ix = lookup(m, key, &slot);
        if (ix < 0) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        drop_value(m, map_delete_at(m, ix, slot));
        return 0;
    }
    uint64_t k, value;
    if (key_for_insert(m, key, &k) < 0 || ensure_table(m) < 0 || unbox(m, v, &value) < 0) {
        return -1;
    }
    Py_ssize_t ix = map_find(m, k, &slot);
    if (ix >= 0) {
        uint64_t old = m->entries[ix].value;
        m->entries[ix].value = value;
        drop_value(m, old);
        return 0;
    }
    if (map_insert_new(m, k, value, slot) < 0) {
        drop_value(m, value);
        return -1;
    }
    return 0;
}

static PyObject *
map_get(MapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    Py_ssize_t slot, ix = lookup(m, args[0], &slot);
    if (ix < 0) {
        return Py_NewRef(nargs == 2 ? args[1] : Py_None);
    }
    return box(m, m->entries[ix].value);
}

/* setdefault(key, default): the value held, or `default` itself once inserted. */
static PyObject *
map_setdefault(MapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "setdefault(key, default)");
        return NULL;
    }
    uint64_t k, value;
    Py_ssize_t slot;
    if (key_for_insert(m, args[0], &k) < 0 || ensure_table(m) < 0) {
        return NULL;
    }
    Py_ssize_t ix = map_find(m, k, &slot);
    if (ix >= 0) {
        return box(m, m->entries[ix].value);
    }
    if (unbox(m, args[1], &value) < 0) {
        return NULL;
    }
    if (map_insert_new(m, k, value, slot) < 0) {
        drop_value(m, value);
        return NULL;
    }
    return Py_NewRef(args[1]);
}

/* What map_set_run does with a key it finds: keeps its value and lists it (`setdefault_run`),
 * keeps it and sums the run up (`weigh_run`), or sets it to the value (`put_run`). */
enum { SET_LIST, SET_RUNS, SET_PUT };

/* SET_RUNS: whether key i's value `v` extends the leading run of the first key's value (`head`,
 * set at key 0), counted in `lead`. */
static inline int
runs_lead(uint64_t v, Py_ssize_t i, uint64_t *head, Py_ssize_t *lead)
{
    if (i == 0) {
        *head = v;
    }
    if (v == *head && *lead == i) {
        (*lead)++;
        return 1;
    }
    return 0;
}

/* The loop of setdefault_run, weigh_run and put_run over `keys`, the run's lookups overlapped
 * (see PREFETCH_AHEAD): a key absent is set to `value`; a key present keeps its value and goes
 * in the list returned (SET_LIST), or is set to `value` and None is returned (SET_PUT). In
 * SET_RUNS the values are summed up as (head, lead, olds): the first key's value, the length
 * of the leading run of keys mapped to it, and None when every key after that run maps to
 * `value` (the values are [head] * lead + [value] * (n - lead)), else the list SET_LIST
 * returns, made only once the values leave that shape. A key that is no u64 int raises
 * TypeError, with the keys before it set. */
static PyObject *
map_set_run(MapObject *m, PyObject *keys, PyObject *value_obj, int mode)
{
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = mode == SET_LIST ? PyList_New(n) : NULL, *result = NULL;
    U64Run run;
    run.v = run.local;
    uint64_t hs_local[U64_LOCAL], *hs = hs_local;
    if ((mode == SET_LIST && out == NULL) || ensure_table(m) < 0) {
        goto done;
    }
    Py_ssize_t ok = u64_run(&run, items, n);
    if (ok < 0) {
        goto done;
    }
    /* Each key mixed once: the prefetch stages, the lookup and the insertion each mixed it. */
    hs = ok <= U64_LOCAL ? hs_local : PyMem_Malloc((size_t)ok * sizeof(uint64_t));
    if (hs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < ok; i++) {
        hs[i] = mix(run.v[i]);
    }
    /* SET_RUNS while `out` is NULL: the values so far are [head] * lead + [value] * rest. */
    uint64_t value_word = m->objects ? (uint64_t)(uintptr_t)value_obj : 0, head = 0;
    Py_ssize_t lead = 0;
    if (mode == SET_RUNS && !m->objects && !as_u64(value_obj, &value_word)) {
        unbox(m, value_obj, &value_word); /* raises: no u64 */
        goto done;
    }
    map_prefetch_start_mixed(m, run.v, hs, ok);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i == ok) {
            uint64_t k;
            key_for_insert(m, items[i], &k); /* raises: no u64 */
            goto done;
        }
        map_prefetch_run_mixed(m, run.v, hs, i, ok);
        uint64_t value;
        Py_ssize_t slot, ix = map_find_mixed(m, run.v[i], hs[i], &slot);
        if (ix >= 0 && mode != SET_PUT) {
            if (out == NULL) {
                uint64_t held = m->entries[ix].value;
                if (runs_lead(held, i, &head, &lead)) {
                    continue;
                }
                if (held == value_word) {
                    continue;
                }
                /* The shape ends here: the list of the values so far, then on as SET_LIST. */
                out = PyList_New(n);
                if (out == NULL) {
                    goto done;
                }
                for (Py_ssize_t j = 0; j < i; j++) {
                    PyObject *v = j < lead ? box(m, head) : Py_NewRef(value_obj);
                    if (v == NULL) {
                        goto done;
                    }
                    PyList_SET_ITEM(out, j, v);
                }
            }
            PyObject *held = box(m, m->entries[ix].value);
            if (held == NULL) {
                goto done;
            }
            PyList_SET_ITEM(out, i, held);
            continue;
        }
        if (unbox(m, value_obj, &value) < 0) {
            goto done;
        }
        if (ix >= 0) {
            uint64_t old = m->entries[ix].value;
            m->entries[ix].value = value;
            drop_value(m, old);
            continue;
        }
        if (map_insert_mixed(m, run.v[i], hs[i], value, slot) < 0) {
            drop_value(m, value);
            goto done;
        }
        if (out != NULL) {
            PyList_SET_ITEM(out, i, Py_NewRef(value_obj));
        }
        else if (mode == SET_RUNS) {
            runs_lead(value_word, i, &head, &lead);
        }
    }
    if (mode != SET_RUNS) {
        result = Py_NewRef(out != NULL ? out : Py_None);
    }
    else if (n == 0) {
        result = Py_BuildValue("(OnO)", Py_None, (Py_ssize_t)0, Py_None);
    }
    else {
        PyObject *first = box(m, head);
        if (first != NULL) {
            result = Py_BuildValue("(NnO)", first, lead, out != NULL ? out : Py_None);
        }
    }
done:
    if (hs != hs_local) {
        PyMem_Free(hs);
    }
    u64_run_free(&run);
    Py_XDECREF(out);
    Py_DECREF(seq);
    return result;
}

/* setdefault_run(keys, default) -> list: [setdefault(k, default) for k in keys]. */
static PyObject *
map_setdefault_run(MapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "setdefault_run(keys, default)");
        return NULL;
    }
    return map_set_run(m, args[0], args[1], SET_LIST);
}

/* weigh_run(keys, default) -> (head, lead, olds): setdefault_run summed up, the list made
 * only when the values are not [head] * lead + [default] * (n - lead) (else None); head is
 * None and lead 0 for no keys. (The pressure ledger's record: a prompt whose head is a prefix
 * one record weighed and whose tail is new to the ledger, the common case, needs no list.) */
static PyObject *
map_weigh_run(MapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "weigh_run(keys, default)");
        return NULL;
    }
    return map_set_run(m, args[0], args[1], SET_RUNS);
}

/* put_run(keys, value): map[k] = value for each of keys. (The pressure ledger's bookings: a
 * prompt's booked blocks map to the booking.) */
static PyObject *
map_put_run(MapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put_run(keys, value)");
        return NULL;
    }
    return map_set_run(m, args[0], args[1], SET_PUT);
}

/* The u64 keys of `obj` when it is a buffer of them (an array('Q'), a replica's ledger keeps
 * its batches' keys so): 1 with `view` held, 0 when it is no such buffer (no error), -1 on
 * error. */
static int
u64_view(PyObject *obj, Py_buffer *view)
{
    if (!PyObject_CheckBuffer(obj)) {
        return 0;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    const char *f = view->format != NULL ? view->format : "B";
    const char *code = (*f == '@' || *f == '=') ? f + 1 : f;
    if (view->itemsize == 8 && (strcmp(code, "Q") == 0 || strcmp(code, "L") == 0)) {
        return 1; /* unsigned, 8 bytes */
    }
    PyErr_Format(PyExc_TypeError, "keys: a buffer of u64 (array('Q')), not format %s", f);
    PyBuffer_Release(view);
    return -1;
}

/* drop_run(keys, start, goal, value) -> (stop, dropped), a NodeMap's: from keys[start] on,
 * delete each key mapped to `value` itself, until `goal` are deleted or the keys end; `stop`
 * is the position after the last key read. `keys` is an array('Q') or a sequence of ints.
 * (The pressure ledger's pruning of a batch: its keys listed in order, some of them mapped to
 * a newer batch since.) */
static PyObject *
map_drop_run(MapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !m->objects) {
        PyErr_SetString(PyExc_TypeError, "NodeMap.drop_run(keys, start, goal, value)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), goal = PyLong_AsSsize_t(args[2]);
    if ((start == -1 || goal == -1) && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer view;
    int viewed = u64_view(args[0], &view);
    if (viewed < 0) {
        return NULL;
    }
    PyObject *seq = NULL, **items = NULL;
    U64Run run;
    run.v = run.local;
    const uint64_t *ks; /* keys[base:base + ok] as u64 */
    Py_ssize_t n, ok, base;
    Py_ssize_t i = start < 0 ? 0 : start, dropped = 0;
    if (viewed) {
        ks = (const uint64_t *)view.buf;
        n = ok = view.len / 8;
        base = 0;
    }
    else {
        seq = PySequence_Fast(args[0], "keys must be a sequence");
        if (seq == NULL) {
            return NULL;
        }
        n = PySequence_Fast_GET_SIZE(seq);
        items = PySequence_Fast_ITEMS(seq);
        base = i < n ? i : n;
        ok = u64_run(&run, items + base, n - base);
        if (ok < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        ks = run.v;
    }
    const uint64_t value = (uint64_t)(uintptr_t)args[3];
    const Py_ssize_t first = i - base; /* the run's position of keys[i] */
    if (m->slots != NULL && first < ok) {
        map_prefetch_start(m, ks + first, ok - first);
    }
    for (; dropped < goal && i < n; i++) {
        uint64_t key;
        if (i - base < ok) {
            if (m->slots != NULL) {
                map_prefetch_run(m, ks + first, i - base - first, ok - first);
            }
            key = ks[i - base];
        }
        else if (!as_u64(items[i], &key)) {
            continue; /* no u64: in no NodeMap */
        }
        Py_ssize_t slot, ix = m->slots == NULL ? -1 : map_find(m, key, &slot);
        if (ix >= 0 && m->entries[ix].value == value) {
            Py_DECREF((PyObject *)(uintptr_t)map_delete_at(m, ix, slot));
            dropped++;
        }
    }
    if (viewed) {
        PyBuffer_Release(&view);
    }
    u64_run_free(&run);
    Py_XDECREF(seq);
    return Py_BuildValue("(nn)", i, dropped);
}

/* kept_run(keys, start, value) -> bytes, a NodeMap's: the native u64s of keys[start:] (an
 * array('Q')) mapped to `value` itself, in order, a key listed twice each time (the caller
 * knows how many distinct ones to expect). (The pressure ledger's compaction of a batch: its
 * stale entries, the keys a newer batch weighed since, left out.) */
static PyObject *
map_kept_run(MapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !m->objects) {
        PyErr_SetString(PyExc_TypeError, "NodeMap.kept_run(keys, start, value)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer view;
    int viewed = u64_view(args[0], &view);
    if (viewed <= 0) {
        if (viewed == 0) {
            PyErr_SetString(PyExc_TypeError, "kept_run: keys must be an array('Q')");
        }
        return NULL;
    }
    const uint64_t *ks = (const uint64_t *)view.buf;
    const Py_ssize_t n = view.len / 8;
    start = start < 0 ? 0 : (start > n ? n : start);
    uint64_t *kept = PyMem_Malloc((size_t)(n - start + 1) * sizeof(uint64_t));
    if (kept == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    const uint64_t value = (uint64_t)(uintptr_t)args[2];
    Py_ssize_t count = 0;
    if (m->slots != NULL && start < n) {
        map_prefetch_start(m, ks + start, n - start);
        for (Py_ssize_t i = start; i < n; i++) {
            map_prefetch_run(m, ks + start, i - start, n - start);
            Py_ssize_t slot, ix = map_find(m, ks[i], &slot);
            if (ix >= 0 && m->entries[ix].value == value) {
                kept[count++] = ks[i];
            }
        }
    }
    PyBuffer_Release(&view);
    PyObject *out = PyBytes_FromStringAndSize((const char *)kept, count * (Py_ssize_t)8);
    PyMem_Free(kept);
    return out;
}

/* move_run(keys, start, stop, old, new) -> moved, a NodeMap's: each of keys[start:stop]
 * mapped to `old` itself is mapped to `new` instead; how many were. A key listed twice moves
 * once. (The pressure ledger weighing a prompt's blocks again: they leave the batch that
 * weighed them last for the new one.) */
static PyObject *
map_move_run(MapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !m->objects) {
        PyErr_SetString(PyExc_TypeError, "NodeMap.move_run(keys, start, stop, old, new)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), stop = PyLong_AsSsize_t(args[2]);
    if ((start == -1 || stop == -1) && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    start = start < 0 ? 0 : (start > n ? n : start);
    stop = stop > n ? n : (stop < start ? start : stop);
    U64Run run;
    Py_ssize_t ok = u64_run(&run, PySequence_Fast_ITEMS(seq) + start, stop - start);
    if (ok < 0) {
        u64_run_free(&run);
        Py_DECREF(seq);
        return NULL;
    }
    /* A key that is no u64 is in no NodeMap, and ends the run u64_run converted: the keys
     * after it are converted one by one. */
    PyObject **items = PySequence_Fast_ITEMS(seq) + start;
    const uint64_t old = (uint64_t)(uintptr_t)args[3];
    PyObject *new = args[4];
    Py_ssize_t moved = 0;
    if (m->slots != NULL) {
        map_prefetch_start(m, run.v, ok);
        for (Py_ssize_t i = 0; i < stop - start; i++) {
            uint64_t key;
            if (i < ok) {
                map_prefetch_run(m, run.v, i, ok);
                key = run.v[i];
            }
            else if (!as_u64(items[i], &key)) {
                continue;
            }
            Py_ssize_t slot, ix = map_find(m, key, &slot);
            if (ix >= 0 && m->entries[ix].value == old) {
                m->entries[ix].value = (uint64_t)(uintptr_t)Py_NewRef(new);
                Py_DECREF((PyObject *)(uintptr_t)old); /* the map held a reference of old */
                moved++;
            }
        }
    }
    u64_run_free(&run);
    Py_DECREF(seq);
    return PyLong_FromSsize_t(moved);
}

static PyObject *
map_pop(MapObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    Py_ssize_t slot, ix = lookup(m, args[0], &slot);
    if (ix < 0) {
        if (nargs == 2) {
            return Py_NewRef(args[1]);
        }
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    uint64_t value = map_delete_at(m, ix, slot);
    if (m->objects) {
        return (PyObject *)(uintptr_t)value; /* the map's reference */
    }
    return PyLong_FromUnsignedLongLong(value);
}

/* popitem(): the newest (key, value), as dict.popitem. */
static PyObject *
map_popitem(MapObject *m, PyObject *unused)
{
    if (m->used == 0) {
        PyErr_Format(PyExc_KeyError, "popitem(): %s is empty", Py_TYPE(m)->tp_name);
        return NULL;
    }
    Py_ssize_t ix = m->n_entries - 1; /* the last entry is live: deletions trim dead ones */
    uint64_t key = m->entries[ix].key;
    PyObject *k = PyLong_FromUnsignedLongLong(key);
    PyObject *v = k ? box(m, m->entries[ix].value) : NULL;
    PyObject *out = v ? PyTuple_Pack(2, k, v) : NULL;
    Py_XDECREF(k);
    Py_XDECREF(v);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t slot;
    map_find(m, key, &slot);
    drop_value(m, map_delete_at(m, ix, slot));
    return out;
}

static PyObject *
map_clear(MapObject *m, PyObject *unused)
{
    map_clear_entries(m);
    if (map_alloc(m, MIN_SIZE) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* reserve(n): room for n entries in all without another rebuild. A graft knows how many
 * nodes it brings: one rebuild up front, while the map is small, replaces the ones a growing
 * map makes on the way, each of which reads all its entries again. The rebuild takes its
 * first step here and its others with the insertions that follow, as any does (see
 * "Rebuilding without a stall"): with a rebuild already under way, nothing is done now (it
 * finishes as it goes, and the next one makes the room). */
static PyObject *
map_reserve(MapObject *m, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0 || n >= MAX_SIZE / 3 * 2) {
        PyErr_Format(PyExc_ValueError, "reserve(%zd): out of range", n);
        return NULL;
    }
    if (ensure_table(m) < 0) {
        return NULL;
    }
    if (m->old_tags != NULL
        || n <= m->usable - (m->filled > m->n_entries ? m->filled : m->n_entries) + m->used) {
        Py_RETURN_NONE;
    }
    const Py_ssize_t room = rebuild_room(m);
    if (map_rebuild_for(m, n > room ? n : room) < 0) {
        return NULL;
    }
    map_migrate(m);
    Py_RETURN_NONE;
}

static PyObject *
map_sizeof(MapObject *m, PyObject *unused)
{
    return PyLong_FromSsize_t(
        Py_TYPE(m)->tp_basicsize
        + (Py_ssize_t)(block_bytes(ENTRIES, m->blocks_size) + block_bytes(LIVE, m->blocks_size)
                       + index_bytes(m->size) + index_bytes(m->old_size)
                       + index_bytes(m->next_size)));
}

/* rehash_left() -> int: the entries a rebuild under way has yet to read (0: none is under
 * way). A test's and a benchmark's view of "Rebuilding without a stall". */
static PyObject *
map_rehash_left(MapObject *m, PyObject *unused)
{
    return PyLong_FromSsize_t(m->old_tags != NULL ? m->n_entries - m->read : 0);
}

static PyObject *
map_repr(MapObject *m)
{
    return PyUnicode_FromFormat("<%s of %zd entries>", Py_TYPE(m)->tp_name, m->used);
}

/* ---- iterators ---- */

enum { ITER_KEYS, ITER_VALUES, ITER_ITEMS };

typedef struct {
    PyObject_HEAD
    MapObject *map; /* NULL once exhausted */
    Py_ssize_t pos;
    uint64_t version;
    int kind;
} MapIterObject;

static PyObject *
make_iter(MapObject *m, int kind)
{
    MapIterObject *it = PyObject_New(MapIterObject, &MapIterType);
    if (it == NULL) {
        return NULL;
    }
    it->map = (MapObject *)Py_NewRef(m);
    it->pos = 0;
    it->version = m->version;
    it->kind = kind;
    return (PyObject *)it;
}

static void
iter_dealloc(MapIterObject *it)
{
    Py_XDECREF(it->map);
    PyObject_Free(it);
}

static PyObject *
iter_next(MapIterObject *it)
{
    MapObject *m = it->map;
    if (m == NULL) {
        return NULL;
    }
    if (m->version != it->version) {
        PyErr_Format(PyExc_RuntimeError, "%s changed during iteration", Py_TYPE(m)->tp_name);
        return NULL;
    }
    while (it->pos < m->n_entries && !m->live[it->pos]) {
        it->pos++;
    }
    if (it->pos >= m->n_entries) {
        it->map = NULL;
        Py_DECREF(m);
        return NULL;
    }
    Entry *e = &m->entries[it->pos++];
    if (it->kind == ITER_KEYS) {
        return PyLong_FromUnsignedLongLong(e->key);
    }
    if (it->kind == ITER_VALUES) {
        return box(m, e->value);
    }
    PyObject *k = PyLong_FromUnsignedLongLong(e->key);
    PyObject *v = k ? box(m, e->value) : NULL;
    PyObject *out = v ? PyTuple_Pack(2, k, v) : NULL;
    Py_XDECREF(k);
    Py_XDECREF(v);
    return out;
}

static PyObject *
iter_length_hint(MapIterObject *it, PyObject *unused)
{
    MapObject *m = it->map;
    return PyLong_FromSsize_t(m == NULL || m->version != it->version ? 0 : m->n_entries - it->pos);
}

static PyMethodDef iter_methods[] = {
    {"__length_hint__", (PyCFunction)iter_length_hint, METH_NOARGS, NULL},
    {NULL},
};

static PyTypeObject MapIterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cachetree._tables.MapIterator",
    .tp_basicsize = sizeof(MapIterObject),
    .tp_dealloc = (destructor)iter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)iter_next,
    .tp_methods = iter_methods,
};

static PyObject *
map_iter(MapObject *m)
{
    return make_iter(m, ITER_KEYS);
}

static PyObject *
map_keys(MapObject *m, PyObject *unused)
{
    return make_iter(m, ITER_KEYS);
}

static PyObject *
map_values(MapObject *m, PyObject *unused)
{
    return make_iter(m, ITER_VALUES);
}

static PyObject *
map_items(MapObject *m, PyObject *unused)
{
    return make_iter(m, ITER_ITEMS);
}

static PyMethodDef map_methods[] = {
    {"get", (PyCFunction)(void (*)(void))map_get, METH_FASTCALL, "get(key, default=None)"},
    {"setdefault", (PyCFunction)(void (*)(void))map_setdefault, METH_FASTCALL,
     "setdefault(key, default): the value held, or `default` itself once inserted"},
    {"drop_run", (PyCFunction)(void (*)(void))map_drop_run, METH_FASTCALL,
     "drop_run(keys, start, goal, value) -> (stop, dropped): a NodeMap's"},
    {"put_run", (PyCFunction)(void (*)(void))map_put_run, METH_FASTCALL,
     "put_run(keys, value): map[k] = value for each of keys"},
    {"kept_run", (PyCFunction)(void (*)(void))map_kept_run, METH_FASTCALL,
     "kept_run(keys, start, value) -> bytes: a NodeMap's"},
    {"move_run", (PyCFunction)(void (*)(void))map_move_run, METH_FASTCALL,
     "move_run(keys, start, stop, old, new) -> moved: a NodeMap's"},
    {"setdefault_run", (PyCFunction)(void (*)(void))map_setdefault_run, METH_FASTCALL,
     "setdefault_run(keys, default) -> [setdefault(k, default) for k in keys]"},
    {"weigh_run", (PyCFunction)(void (*)(void))map_weigh_run, METH_FASTCALL,
     "weigh_run(keys, default) -> (head, lead, olds): setdefault_run summed up"},
    {"pop", (PyCFunction)(void (*)(void))map_pop, METH_FASTCALL, "pop(key[, default])"},
    {"popitem", (PyCFunction)map_popitem, METH_NOARGS, "the newest (key, value), removed"},
    {"clear", (PyCFunction)map_clear, METH_NOARGS, "remove every entry"},
    {"reserve", (PyCFunction)map_reserve, METH_O,
     "reserve(n): room for n entries in all, rebuilding (once) now if need be"},
    {"rehash_left", (PyCFunction)map_rehash_left, METH_NOARGS,
     "the entries a rebuild under way has yet to read (0: none is)"},
    {"keys", (PyCFunction)map_keys, METH_NOARGS, "an iterator over the keys, oldest first"},
    {"values", (PyCFunction)map_values, METH_NOARGS, "an iterator over the values"},
    {"items", (PyCFunction)map_items, METH_NOARGS, "an iterator over (key, value) pairs"},
    {"__sizeof__", (PyCFunction)map_sizeof, METH_NOARGS, NULL},
    {NULL},
};

static PySequenceMethods map_as_sequence = {
    .sq_contains = (objobjproc)map_contains,
};

static PyMappingMethods map_as_mapping = {
    .mp_length = (lenfunc)map_length,
    .mp_subscript = (binaryfunc)map_subscript,
    .mp_ass_subscript = (objobjargproc)map_ass_subscript,
};

static PyTypeObject NodeMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cachetree._tables.NodeMap",
    .tp_basicsize = sizeof(MapObject),
    .tp_dealloc = (destructor)map_dealloc,
    .tp_repr = (reprfunc)map_repr,
    .tp_as_sequence = &map_as_sequence,
    .tp_as_mapping = &map_as_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "NodeMap(): u64 key -> Node, insertion-ordered (the index's key -> node dict).",
    .tp_iter = (getiterfunc)map_iter,
    .tp_methods = map_methods,
    .tp_new = map_new,
};

static PyTypeObject HashMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cachetree._tables.HashMap",
    .tp_basicsize = sizeof(MapObject),
    .tp_dealloc = (destructor)map_dealloc,
    .tp_repr = (reprfunc)map_repr,
    .tp_as_sequence = &map_as_sequence,
    .tp_as_mapping = &map_as_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "HashMap(): u64 -> u64, insertion-ordered (a rank's engine hash -> key dict).",
    .tp_iter = (getiterfunc)map_iter,
    .tp_methods = map_methods,
    .tp_new = map_new,
};

/* ---- the tree's runs (twins of cachetree/tree.py _remove_run_py, _place_run_py) --------- */

/* The node under `key` (borrowed), or NULL: absent, or not a Node. */
static inline NodeObject *
node_at(const MapObject *nodes, uint64_t key)
{
    Py_ssize_t slot, ix = map_find(nodes, key, &slot);
    if (ix < 0) {
        return NULL;
    }
    PyObject *node = (PyObject *)(uintptr_t)nodes->entries[ix].value;
    return Py_TYPE(node) == &NodeType ? (NodeObject *)node : NULL;
}

/* Delete `key` from `nodes`; the node stays alive while the caller holds a reference. */
static void
delete_node(MapObject *nodes, uint64_t key)
{
    Py_ssize_t slot, ix = map_find(nodes, key, &slot);
    if (ix >= 0) {
        drop_value(nodes, map_delete_at(nodes, ix, slot));
    }
}

/* Does the node's tiers dict name rank `index_obj`? -1 on error. */
static inline int
tiers_name(NodeObject *n, PyObject *index_obj)
{
    PyObject *tiers = node_tiers(n);
    return tiers == NULL ? 0 : PyDict_Contains(tiers, index_obj);
}

static inline int
dict_discard(PyObject *dict, PyObject *key)
{
    if (PyDict_DelItem(dict, key) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
            return -1;
        }
        PyErr_Clear();
    }
    return 0;
}

/* A node with no carrier: its mask is the native zero. */
static inline int
bare(NodeObject *n)
{
    return native_mask(n) && n->mask == 0;
}

/* tree.py _drop_carrier: clear rank `index` from the node, then prune what is left bare. */
static int
drop_carrier(MapObject *nodes, uint64_t key, NodeObject *node, Py_ssize_t index,
             PyObject *index_obj)
{
    Extra *x = extra_of(node);
    if (native_mask(node)) {
        node->mask &= ~((uint64_t)1 << index);
    }
    else {
        PyObject *one = PyLong_FromLong(1);
        PyObject *bit = one ? PyNumber_Lshift(one, index_obj) : NULL;
        PyObject *not_bit = bit ? PyNumber_Invert(bit) : NULL;
        Py_XDECREF(one);
        PyObject *mask = not_bit ? PyNumber_And(x->mask, not_bit) : NULL;
        Py_XDECREF(bit);
        Py_XDECREF(not_bit);
        if (mask == NULL || set_mask(node, mask) < 0) {
            Py_XDECREF(mask);
            return -1;
        }
        Py_DECREF(mask);
    }
    x = extra_of(node);
    if (x != NULL && x->tiers != NULL) {
        if (dict_discard(x->tiers, index_obj) < 0) {
            return -1;
        }
        if (PyDict_GET_SIZE(x->tiers) == 0) {
            Py_CLEAR(x->tiers);
            compact(node);
        }
    }
    x = extra_of(node);
    if (x != NULL && x->ehash != NULL && PyDict_CheckExact(x->ehash)
        && dict_discard(x->ehash, index_obj) < 0) {
        return -1;
    }
    Py_INCREF(node);
    while (bare(node) && node->children == 0) {
        int has_parent = node->flags & F_PARENT;
        uint64_t parent_key = node->parent;
        delete_node(nodes, key);
        Py_DECREF(node);
        if (!has_parent) {
            return 0;
        }
        node = node_at(nodes, parent_key);
        if (node == NULL || node->children == 0) {
            PyObject *k = PyLong_FromUnsignedLongLong(parent_key);
            PyErr_SetObject(PyExc_KeyError, k);
            Py_XDECREF(k);
            return -1;
        }
        Py_INCREF(node);
        node->children--;
        key = parent_key;
    }
    Py_DECREF(node);
    return 0;
}

static int
check_maps(PyObject *nodes, PyObject *by_hash, const char *usage)
{
    if (Py_TYPE(nodes) != &NodeMapType || Py_TYPE(by_hash) != &HashMapType) {
        PyErr_Format(PyExc_TypeError, "%s: nodes is a NodeMap and by_hash a HashMap", usage);
        return -1;
    }
    return 0;
}

/* The prefetch stages of a run of removals of the engine hashes `ehs[0:n]` (mixed: `hs[0:n]`),
 * the run at hash i. A removal is a chain of dependent loads: the by_hash slot, its entry (the
 * block's key), the nodes slot of that key, its entry, the node. The blocks an engine evicts
 * are its coldest, so each is a cache miss; each stage fetches one link PREFETCH_AHEAD hashes
 * after the stage before it did the link before (read then, it has landed): hash i + 5 *
 * PREFETCH_AHEAD gets its by_hash slot, ..., hash i + PREFETCH_AHEAD its node. The node's
 * parent is not fetched: engines evict leaf first, so it is nearly always the next hash's
 * node, or a shared prefix's, which is warm. i may be negative (before the run's loop). */
static inline void
remove_prefetch_run(const MapObject *nodes, const MapObject *by_hash, const uint64_t *ehs,
                    const uint64_t *hs, Py_ssize_t i, Py_ssize_t n)
{
    const Py_ssize_t a = PREFETCH_AHEAD;
    const Entry *e, *ne;
    Py_ssize_t j = i + 5 * a;
    if (j >= 0 && j < n) {
        map_prefetch_mixed(by_hash, hs[j]);
    }
    j -= a;
    if (j >= 0 && j < n && (e = map_peek(by_hash, hs[j])) != NULL) {
        PREFETCH(e);
        PREFETCH(&by_hash->live[e - by_hash->entries]); /* the deletion clears it */
    }
    j -= a;
    if (j >= 0 && j < n && (e = map_peek_found(by_hash, ehs[j], hs[j])) != NULL) {
        map_prefetch_mixed(nodes, mix(e->value));
    }
    j -= a;
    if (j >= 0 && j < n && (e = map_peek_found(by_hash, ehs[j], hs[j])) != NULL
        && (ne = map_peek(nodes, mix(e->value))) != NULL) {
        PREFETCH(ne);
        PREFETCH(&nodes->live[ne - nodes->entries]);
    }
    j -= a;
    if (j >= 0 && j < n && (e = map_peek_found(by_hash, ehs[j], hs[j])) != NULL
        && (ne = map_peek_found(nodes, e->value, mix(e->value))) != NULL) {
        PREFETCH((const void *)(uintptr_t)ne->value);
    }
}

/* remove_run(nodes, by_hash, hashes, start, index, device) -> (stop, found, dropped, unknown) */
static PyObject *
py_remove_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char usage[] = "remove_run(nodes, by_hash, hashes: list, start, index, device)";
    if (nargs != 6 || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    if (check_maps(args[0], args[1], usage) < 0) {
        return NULL;
    }
    MapObject *nodes = (MapObject *)args[0], *by_hash = (MapObject *)args[1];
    PyObject *hashes = args[2], *index_obj = args[4];
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    Py_ssize_t index = PyLong_AsSsize_t(index_obj);
    int device = PyObject_IsTrue(args[5]);
    if ((start == -1 || index == -1 || device < 0) && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    Py_ssize_t found = 0, unknown = 0, i = start < 0 ? 0 : start;
    if (index < 0 || index > 63 || !device || nodes->slots == NULL || by_hash->slots == NULL) {
        return Py_BuildValue("(nnnn)", i < n ? i : n, (Py_ssize_t)0, (Py_ssize_t)0,
                             (Py_ssize_t)0); /* all general */
    }
    uint64_t bit = (uint64_t)1 << index;
    U64Run run;
    const Py_ssize_t base = i < n ? i : n; /* run.v[k] is hashes[base + k] */
    Py_ssize_t ok = u64_run(&run, PySequence_Fast_ITEMS(hashes) + base, n - base);
    PyObject *result = NULL;
    uint64_t hs_local[U64_LOCAL], *hs = hs_local;
    if (ok < 0) {
        goto done;
    }
    /* Each hash mixed once: the prefetch stages read it several times. */
    if (ok > U64_LOCAL && (hs = PyMem_Malloc((size_t)ok * sizeof(uint64_t))) == NULL) {
        hs = hs_local;
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < ok; k++) {
        hs[k] = mix(run.v[k]);
    }
    for (Py_ssize_t p = -5 * PREFETCH_AHEAD; p < 0; p++) {
        remove_prefetch_run(nodes, by_hash, run.v, hs, p, ok);
    }
    for (; i < n; i++) {
        remove_prefetch_run(nodes, by_hash, run.v, hs, i - base, ok);
        PyObject *eh_obj = PyList_GET_ITEM(hashes, i);
        uint64_t eh;
        if (i - base < ok) {
            eh = run.v[i - base]; /* converted once, up front */
        }
        else if (!as_u64(eh_obj, &eh)) {
            if (PyLong_Check(eh_obj)) {
                unknown++; /* no u64: held by no map */
                continue;
            }
            break;
        }
        Py_ssize_t hslot, hix = i - base < ok ? map_find_mixed(by_hash, eh, hs[i - base], &hslot)
                                              : map_find(by_hash, eh, &hslot);
        if (hix < 0) {
            unknown++;
            continue;
        }
        uint64_t key = by_hash->entries[hix].value;
        Py_ssize_t nslot, nix = map_find(nodes, key, &nslot);
        NodeObject *node = nix < 0 ? NULL : (NodeObject *)(uintptr_t)nodes->entries[nix].value;
        if (node == NULL || Py_TYPE(node) != &NodeType) {
            break; /* the general path raises */
        }
        int named = tiers_name(node, index_obj);
        if (named < 0) {
            goto done;
        }
        if (named || !native_mask(node) || !(node->mask & bit)) {
            break;
        }
        found++;
        map_delete_at(by_hash, hix, hslot);
        if (node->mask == bit && node->children == 0) {
            /* Its only carrier, and a leaf: the node goes; its parent only if left bare. */
            node->mask = 0;
            int has_parent = node->flags & F_PARENT;
            uint64_t parent_key = node->parent;
            /* Its slot as found above: nothing was inserted since (a deletion moves nothing). */
            drop_value(nodes, map_delete_at(nodes, nix, nslot));
            if (!has_parent) {
                continue;
            }
            NodeObject *parent = node_at(nodes, parent_key);
            if (parent == NULL || parent->children == 0) {
                PyObject *k = PyLong_FromUnsignedLongLong(parent_key);
                PyErr_SetObject(PyExc_KeyError, k);
                Py_XDECREF(k);
                goto done;
            }
            parent->children--;
            if (parent->children == 0 && bare(parent)
                && drop_carrier(nodes, parent_key, parent, index, index_obj) < 0) {
                goto done;
            }
            continue;
        }
        if (drop_carrier(nodes, key, node, index, index_obj) < 0) {
            goto done;
        }
    }
    result = Py_BuildValue("(nnnn)", i, found, found, unknown);
done:
    if (hs != hs_local) {
        PyMem_Free(hs);
    }
    u64_run_free(&run);
    return result;
}

/* The engine hash a carrier `index_obj` of `node` is known by: 1 and *out, or 0 (none, or not
 * a u64), -1 on error. */
static inline int
carrier_ehash(NodeObject *node, PyObject *index_obj, uint64_t *out)
{
    Extra *x = extra_of(node);
    if (x == NULL) {
        *out = node->u.ehash;
        return (node->flags & F_EHASH) != 0;
    }
    PyObject *eh = x->ehash;
    if (eh != NULL && PyDict_CheckExact(eh)) {
        eh = PyDict_GetItemWithError(eh, index_obj);
        if (eh == NULL) {
            return PyErr_Occurred() ? -1 : 0;
        }
    }
    return eh != NULL && as_u64(eh, out);
}

/* place_run(nodes, by_hash, keys, hashes, start, parent_key, index) -> (stop, added) */
static PyObject *
py_place_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char usage[] = "place_run(nodes, by_hash, keys, hashes, start, parent_key, index)";
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    if (check_maps(args[0], args[1], usage) < 0) {
        return NULL;
    }
    MapObject *nodes = (MapObject *)args[0], *by_hash = (MapObject *)args[1];
    PyObject *index_obj = args[6];
    Py_ssize_t start = PyLong_AsSsize_t(args[4]);
    Py_ssize_t index = PyLong_AsSsize_t(index_obj);
    if ((start == -1 || index == -1) && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *keys_seq = PySequence_Fast(args[2], "keys must be a sequence");
    if (keys_seq == NULL) {
        return NULL;
    }
    PyObject *hashes_seq = PySequence_Fast(args[3], "engine hashes must be a sequence");
    if (hashes_seq == NULL) {
        Py_DECREF(keys_seq);
        return NULL;
    }
    PyObject **keys = PySequence_Fast_ITEMS(keys_seq);
    PyObject **hashes = PySequence_Fast_ITEMS(hashes_seq);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys_seq);
    if (PySequence_Fast_GET_SIZE(hashes_seq) < n) {
        n = PySequence_Fast_GET_SIZE(hashes_seq); /* zip() semantics, as the general path */
    }
    Py_ssize_t added = 0, i = start < 0 ? 0 : (start < n ? start : n);
    PyObject *result = NULL;
    U64Run kr, hr; /* the keys and hashes from i on, as u64s */
    kr.v = kr.local;
    hr.v = hr.local;
    NodeObject *parent = NULL;
    uint64_t parent_key = 0;
    int has_parent = args[5] != Py_None;
    if (index < 0 || index > 63 || nodes->slots == NULL || by_hash->slots == NULL) {
        goto done; /* a mask past one machine word: all general */
    }
    uint64_t bit = (uint64_t)1 << index;
    if (has_parent) {
        if (!as_u64(args[5], &parent_key) || (parent = node_at(nodes, parent_key)) == NULL) {
            goto done; /* the general path raises */
        }
        Py_INCREF(parent);
    }
    const Py_ssize_t base = i;
    Py_ssize_t nk = u64_run(&kr, keys + base, n - base);
    Py_ssize_t nh = nk < 0 ? -1 : u64_run(&hr, hashes + base, n - base);
    if (nh < 0) {
        goto error;
    }
    /* The run stops at the first key or hash that is no u64: the general path takes it. */
    const Py_ssize_t ok = nk < nh ? nk : nh;
    map_prefetch_start(nodes, kr.v, ok);
    map_prefetch_start(by_hash, hr.v, ok);
    for (; i < base + ok; i++) {
        map_prefetch_run(nodes, kr.v, i - base, ok);
        map_prefetch_run(by_hash, hr.v, i - base, ok);
        const uint64_t key = kr.v[i - base], eh = hr.v[i - base];
        Py_ssize_t hslot, hix = map_find(by_hash, eh, &hslot);
        if (hix >= 0 && by_hash->entries[hix].value != key) {
            break;
        }
        Py_ssize_t nslot, nix = map_find(nodes, key, &nslot);
        NodeObject *node;
        if (nix < 0) {
            node = new_node();
            if (node == NULL) {
                goto error;
            }
            node->parent = parent_key;
            node->flags = (has_parent ? F_PARENT : 0) | F_EHASH;
            node->mask = bit;
            node->u.ehash = eh;
            if (parent != NULL && parent->children == UINT32_MAX) {
                Py_DECREF(node);
                break;
            }
            if (map_insert_new(nodes, key, (uint64_t)(uintptr_t)node, nslot) < 0) {
                Py_DECREF(node);
                goto error;
            }
            if (parent != NULL) {
                parent->children++;
            }
            added++;
        }
        else {
            node = (NodeObject *)(uintptr_t)nodes->entries[nix].value;
            if (Py_TYPE(node) != &NodeType || !native_mask(node)) {
                break;
            }
            int named = tiers_name(node, index_obj);
            if (named < 0) {
                goto error;
            }
            if (named) {
                break;
            }
            Extra *x = extra_of(node);
            if (!(node->mask & bit)) {
                if (x != NULL && x->ehash != NULL && PyDict_CheckExact(x->ehash)) {
                    PyObject *v = PyLong_FromUnsignedLongLong(eh);
                    int status = v ? PyDict_SetItem(x->ehash, index_obj, v) : -1;
                    Py_XDECREF(v);
                    if (status < 0) {
                        goto error;
                    }
                }
                else if (node->mask == 0) {
                    PyObject *v = PyLong_FromUnsignedLongLong(eh);
                    int status = v ? set_ehash(node, v) : -1;
                    Py_XDECREF(v);
                    if (status < 0) {
                        goto error;
                    }
                }
                else {
                    uint64_t old;
                    int known = carrier_ehash(node, index_obj, &old);
                    if (known < 0) {
                        goto error;
                    }
                    if (!known || old != eh) {
                        break;
                    }
                }
                node->mask |= bit;
                added++;
            }
            else {
                uint64_t old;
                int known = carrier_ehash(node, index_obj, &old);
                if (known < 0) {
                    goto error;
                }
                if (!known || old != eh) {
                    break;
                }
            }
        }
        if (hix < 0) {
            /* The node insertion may have rebuilt nothing of by_hash: its slot still holds. */
            if (map_insert_new(by_hash, eh, key, hslot) < 0) {
                goto error;
            }
        }
        Py_INCREF(node);
        Py_XSETREF(parent, node);
        parent_key = key;
        has_parent = 1;
    }
done:
    result = Py_BuildValue("(nn)", i, added);
error:
    u64_run_free(&kr);
    u64_run_free(&hr);
    Py_XDECREF(parent);
    Py_DECREF(keys_seq);
    Py_DECREF(hashes_seq);
    return result;
}


/* ---- the graft's creation of new records (twin: cachetree/snapshot.py SnapshotRestore) ---- */

typedef struct {
    Py_buffer view;
    int held;
} Column;

static int
column(PyObject *obj, Column *col, char format, Py_ssize_t itemsize, const char *name)
{
    if (PyObject_GetBuffer(obj, &col->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    col->held = 1;
    const char *f = col->view.format ? col->view.format : "B";
    if (col->view.itemsize != itemsize || f[0] != format || f[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "graft_new: %s is not an array('%c')", name, format);
        return -1;
    }
    return 0;
}

enum { GRAFT_DONE, GRAFT_HASH_TAKEN, GRAFT_DUPLICATE_KEY, GRAFT_PARENT_GONE };

/* Undo the creation of records [a, upto) flagged in `new` (newest first, so a child goes
 * before its parent). */
static void
undo_nodes(MapObject *nodes, const uint64_t *keys, const uint8_t *new, Py_ssize_t a,
           Py_ssize_t upto)
{
    for (Py_ssize_t i = upto - 1; i >= a; i--) {
        if (!new[i - a]) {
            continue;
        }
        NodeObject *node = node_at(nodes, keys[i]);
        if (node == NULL) {
            continue;
        }
        if (node->flags & F_PARENT) {
            NodeObject *parent = node_at(nodes, node->parent);
            if (parent != NULL && parent->children) {
                parent->children--;
            }
        }
        delete_node(nodes, keys[i]);
    }
}

/* graft_new(nodes, maps, index_of, keys, parents, counts, workers, hashes, new, a, b, c0)
 *   -> (code, record)
 *
 * SnapshotRestore._create for a chunk [a, b) of records whose carriers are all on the device
 * tier: the records flagged in `new` (bytes, one per record of the chunk) are created with
 * their parents' child counts raised, then each carrier's engine hash goes into its rank's
 * map. Columns are the snapshot's (keys u64, parents i64 record indices, counts u32,
 * workers u32 indices into `maps` and `index_of`, hashes u64); the chunk's carriers start at
 * `c0`. code 0: done. Otherwise nothing is changed and `record` names the culprit: 1 an
 * engine hash the rank maps already (or twice in the chunk), 2 a key the tree holds or the
 * chunk repeats, 3 a parent that is not in the tree. */
static PyObject *
py_graft_new(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char usage[] = "graft_new(nodes, maps, index_of, keys, parents, counts, "
                                "workers, hashes, new, a, b, c0)";
    if (nargs != 12 || Py_TYPE(args[0]) != &NodeMapType || !PyList_CheckExact(args[1])
        || !PyList_CheckExact(args[2]) || PyList_GET_SIZE(args[1]) != PyList_GET_SIZE(args[2])) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    MapObject *nodes = (MapObject *)args[0];
    Py_ssize_t n_maps = PyList_GET_SIZE(args[1]);
    Py_ssize_t a = PyLong_AsSsize_t(args[9]), b = PyLong_AsSsize_t(args[10]);
    Py_ssize_t c0 = PyLong_AsSsize_t(args[11]);
    if ((a == -1 || b == -1 || c0 == -1) && PyErr_Occurred()) {
        return NULL;
    }
    Column keys_c = {0}, parents_c = {0}, counts_c = {0}, workers_c = {0}, hashes_c = {0},
           new_c = {0};
    MapObject **maps = NULL;
    uint64_t *bits = NULL;
    PyObject *result = NULL;
    int code = GRAFT_DONE;
    Py_ssize_t culprit = -1;
    if (column(args[3], &keys_c, 'Q', 8, "keys") < 0
        || column(args[4], &parents_c, 'q', 8, "parents") < 0
        || column(args[5], &counts_c, 'I', 4, "counts") < 0
        || column(args[6], &workers_c, 'I', 4, "workers") < 0
        || column(args[7], &hashes_c, 'Q', 8, "hashes") < 0
        || column(args[8], &new_c, 'B', 1, "new") < 0) {
        goto done;
    }
    const uint64_t *keys = keys_c.view.buf;
    const int64_t *parents = parents_c.view.buf;
    const uint32_t *counts = counts_c.view.buf;
    const uint32_t *workers = workers_c.view.buf;
    const uint64_t *hashes = hashes_c.view.buf;
    const uint8_t *new = new_c.view.buf;
    Py_ssize_t n_keys = keys_c.view.len / 8, n_carriers = workers_c.view.len / 4;
    if (a < 0 || b < a || b > n_keys || parents_c.view.len / 8 != n_keys
        || counts_c.view.len / 4 != n_keys || hashes_c.view.len / 8 != n_carriers
        || new_c.view.len != b - a || c0 < 0 || nodes->slots == NULL) {
        PyErr_SetString(PyExc_ValueError, "graft_new: columns and range disagree");
        goto done;
    }
    maps = PyMem_Malloc(sizeof(MapObject *) * (n_maps ? n_maps : 1));
    bits = PyMem_Malloc(sizeof(uint64_t) * (n_maps ? n_maps : 1));
    if (maps == NULL || bits == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t w = 0; w < n_maps; w++) {
        PyObject *m = PyList_GET_ITEM(args[1], w);
        Py_ssize_t index = PyLong_AsSsize_t(PyList_GET_ITEM(args[2], w));
        if (Py_TYPE(m) != &HashMapType || index < 0 || index > 63 || ((MapObject *)m)->slots == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError,
                                "graft_new: maps are HashMaps and rank indices in [0, 64)");
            }
            goto done;
        }
        maps[w] = (MapObject *)m;
        bits[w] = (uint64_t)1 << index;
    }
    /* The chunk's carriers must lie in the columns, and name known workers. */
    Py_ssize_t c_end = c0;
    for (Py_ssize_t i = a; i < b; i++) {
        c_end += counts[i];
    }
    if (c_end > n_carriers) {
        PyErr_SetString(PyExc_ValueError, "graft_new: carrier counts overrun the columns");
        goto done;
    }
    for (Py_ssize_t j = c0; j < c_end; j++) {
        if (workers[j] >= (uint64_t)n_maps) {
            PyErr_SetString(PyExc_ValueError, "graft_new: a worker index is out of range");
            goto done;
        }
    }

    /* Nodes first (as the pure graft: a repeated key is found before any hash). */
    Py_ssize_t i = a, c = c0;
    NodeObject *last = NULL; /* the node of record i - 1 when it was created here */
    for (; i < b; c += counts[i], i++) {
        NodeObject *last_here = last;
        last = NULL;
        if (!new[i - a]) {
            continue;
        }
        uint64_t key = keys[i];
        Py_ssize_t slot;
        if (map_find(nodes, key, &slot) >= 0) {
            code = GRAFT_DUPLICATE_KEY;
            break;
        }
        int64_t p = parents[i];
        NodeObject *parent = NULL;
        if (p >= 0) {
            if (p >= n_keys) {
                code = GRAFT_PARENT_GONE;
                break;
            }
            parent = (p == i - 1 && last_here != NULL) ? last_here : node_at(nodes, keys[p]);
            if (parent == NULL || parent->children == UINT32_MAX) {
                code = GRAFT_PARENT_GONE;
                break;
            }
        }
        NodeObject *node = new_node();
        if (node == NULL) {
            goto failed;
        }
        node->parent = p >= 0 ? keys[p] : 0;
        node->flags = p >= 0 ? F_PARENT : 0;
        uint32_t n = counts[i];
        uint64_t mask = 0;
        int same = 1;
        for (uint32_t k = 0; k < n; k++) {
            mask |= bits[workers[c + k]];
            same &= hashes[c + k] == hashes[c];
        }
        node->mask = mask;
        if (n && same) {
            node->u.ehash = hashes[c];
            node->flags |= F_EHASH;
        }
        else if (n) {
            PyObject *per = PyDict_New();
            int status = per ? 0 : -1;
            for (uint32_t k = 0; k < n && status == 0; k++) {
                uint32_t w = workers[c + k];
                PyObject *index = PyLong_FromLong(__builtin_ctzll(bits[w]));
                PyObject *eh = PyLong_FromUnsignedLongLong(hashes[c + k]);
                status = (index && eh) ? PyDict_SetItem(per, index, eh) : -1;
                Py_XDECREF(index);
                Py_XDECREF(eh);
            }
            if (status == 0) {
                status = set_ehash(node, per);
            }
            Py_XDECREF(per);
            if (status < 0) {
                Py_DECREF(node);
                goto failed;
            }
        }
        if (map_insert_new(nodes, key, (uint64_t)(uintptr_t)node, slot) < 0) {
            Py_DECREF(node);
            goto failed;
        }
        if (parent != NULL) {
            parent->children++;
        }
        last = node;
    }
    if (code != GRAFT_DONE) {
        culprit = i;
        undo_nodes(nodes, keys, new, a, i);
        goto answer;
    }

    /* Then each carrier's engine hash into its rank's map; one already there refuses all. */
    for (i = a, c = c0; i < b; i++) {
        uint32_t n = counts[i];
        if (!new[i - a]) {
            c += n;
            continue;
        }
        for (uint32_t k = 0; k < n; k++, c++) {
            MapObject *m = maps[workers[c]];
            Py_ssize_t slot;
            if (map_find(m, hashes[c], &slot) >= 0) {
                code = GRAFT_HASH_TAKEN;
                break;
            }
            if (map_insert_new(m, hashes[c], keys[i], slot) < 0) {
                code = -1;
                break;
            }
        }
        if (code != GRAFT_DONE) {
            break;
        }
    }
    if (code != GRAFT_DONE) {
        /* Take back every hash inserted so far: up to carrier c of record i. */
        Py_ssize_t stop = c;
        for (Py_ssize_t r = a, cc = c0; r <= i && r < b; r++) {
            uint32_t n = counts[r];
            for (uint32_t k = 0; k < n && cc < stop; k++, cc++) {
                if (!new[r - a]) {
                    continue;
                }
                MapObject *m = maps[workers[cc]];
                Py_ssize_t slot, ix = map_find(m, hashes[cc], &slot);
                if (ix >= 0 && m->entries[ix].value == keys[r]) {
                    map_delete_at(m, ix, slot);
                }
            }
            if (cc >= stop) {
                break;
            }
        }
        undo_nodes(nodes, keys, new, a, b);
        if (code < 0) {
            goto done; /* out of memory, error set */
        }
        culprit = i;
    }
answer:
    result = Py_BuildValue("(in)", code, culprit);
    goto done;
failed:
    culprit = i;
    {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        undo_nodes(nodes, keys, new, a, i);
        PyErr_Restore(type, value, tb);
    }
done:
    PyMem_Free(maps);
    PyMem_Free(bits);
    Column *cols[] = {&keys_c, &parents_c, &counts_c, &workers_c, &hashes_c, &new_c};
    for (int k = 0; k < 6; k++) {
        if (cols[k]->held) {
            PyBuffer_Release(&cols[k]->view);
        }
    }
    return result;
}


/* ---- the export's walk (twin: cachetree/snapshot.py SnapshotExport._walk) ---------------- */

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
} Bytes;

static int
put(Bytes *b, const void *data, Py_ssize_t n)
{
    if (b->len + n > b->cap) {
        Py_ssize_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap < b->len + n) {
            cap *= 2;
        }
        char *grown = PyMem_Realloc(b->buf, (size_t)cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->buf = grown;
        b->cap = cap;
    }
    memcpy(b->buf + b->len, data, (size_t)n);
    b->len += n;
    return 0;
}

/* walk_chunk(nodes, keys, table, first, last_key) -> (parents, keys, counts, workers, tiers,
 *   hashes, branches, last_key) | None
 *
 * The columns of a listed chunk (`nodes` a tuple of Nodes, `keys` their u64 keys) as bytes
 * of the snapshot's array types, for the nodes still in the tree (a node that left has no
 * carrier and no child). Record numbers start at `first`; a node whose parent is the record
 * before it (`last_key` for the first) gets that record, a root -1, and any other parent
 * first + j - 1 with (record, parent key) in `branches`, for the caller to resolve. `table`
 * maps a rank index to its worker-table position. None when a node is not of the native
 * shape (a mask past 64 ranks, a rank missing from `table`): the caller walks the chunk. */
static PyObject *
py_walk_chunk(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyTuple_CheckExact(args[0]) || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "walk_chunk(nodes: tuple, keys, table: list, first, last_key)");
        return NULL;
    }
    PyObject *objs = args[0], *table_obj = args[2], *last_obj = args[4];
    Py_ssize_t first = PyLong_AsSsize_t(args[3]);
    if (first == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Column keys_c = {0};
    if (column(args[1], &keys_c, 'Q', 8, "keys") < 0) {
        if (keys_c.held) {
            PyBuffer_Release(&keys_c.view);
        }
        return NULL;
    }
    const uint64_t *keys = keys_c.view.buf;
    Py_ssize_t n = PyTuple_GET_SIZE(objs);
    PyObject *result = NULL, *branches = NULL;
    Bytes parents = {0}, out_keys = {0}, counts = {0}, workers = {0}, tiers = {0}, hashes = {0};
    int32_t table[64];
    Py_ssize_t n_table = PyList_GET_SIZE(table_obj);
    if (keys_c.view.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "walk_chunk: nodes and keys differ in length");
        goto done;
    }
    for (int i = 0; i < 64; i++) {
        table[i] = -1;
        if (i < n_table) {
            long t = PyLong_AsLong(PyList_GET_ITEM(table_obj, i));
            if (t == -1 && PyErr_Occurred()) {
                goto done;
            }
            table[i] = t < 0 || t > INT32_MAX ? -1 : (int32_t)t;
        }
    }
    uint64_t last = 0;
    int has_last = 0;
    if (last_obj != Py_None) {
        if (!as_u64(last_obj, &last)) {
            PyErr_SetString(PyExc_TypeError, "walk_chunk: last_key is a u64 key or None");
            goto done;
        }
        has_last = 1;
    }
    branches = PyList_New(0);
    if (branches == NULL) {
        goto done;
    }
    Py_ssize_t record = first;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *obj = PyTuple_GET_ITEM(objs, j);
        if (Py_TYPE(obj) != &NodeType) {
            goto fallback;
        }
        NodeObject *node = (NodeObject *)obj;
        if (!native_mask(node)) {
            goto fallback;
        }
        uint64_t mask = node->mask;
        if (mask == 0 && node->children == 0) {
            continue; /* it has left the tree */
        }
        int64_t parent = record - 1;
        if (!(node->flags & F_PARENT)) {
            parent = -1;
        }
        else if (!has_last || node->parent != last) {
            PyObject *pair = Py_BuildValue("(nK)", record, (unsigned long long)node->parent);
            int status = pair ? PyList_Append(branches, pair) : -1;
            Py_XDECREF(pair);
            if (status < 0) {
                goto done;
            }
        }
        uint32_t count = (uint32_t)__builtin_popcountll(mask);
        Extra *x = extra_of(node);
        PyObject *tier_dict = x ? x->tiers : NULL;
        PyObject *eh_obj = x ? x->ehash : NULL;
        uint64_t shared = node->u.ehash;
        int per_carrier = eh_obj != NULL && PyDict_CheckExact(eh_obj);
        if (x != NULL && !per_carrier && count) {
            if (eh_obj == NULL || !as_u64(eh_obj, &shared)) {
                goto fallback;
            }
        }
        else if (x == NULL && count && !(node->flags & F_EHASH)) {
            goto fallback;
        }
        if (put(&parents, &parent, 8) < 0 || put(&out_keys, &keys[j], 8) < 0
            || put(&counts, &count, 4) < 0) {
            goto done;
        }
        for (uint64_t m = mask; m; m &= m - 1) {
            int index = __builtin_ctzll(m);
            if (table[index] < 0) {
                goto fallback;
            }
            uint32_t w = (uint32_t)table[index];
            uint8_t bits = 1; /* DEVICE */
            uint64_t eh = shared;
            if (tier_dict != NULL || per_carrier) {
                PyObject *index_obj = PyLong_FromLong(index);
                if (index_obj == NULL) {
                    goto done;
                }
                PyObject *v = tier_dict ? PyDict_GetItemWithError(tier_dict, index_obj) : NULL;
                uint64_t t;
                if (v != NULL) {
                    if (!as_u64(v, &t) || t > 255) {
                        Py_DECREF(index_obj);
                        goto fallback;
                    }
                    bits = (uint8_t)t;
                }
                PyObject *e = per_carrier && !PyErr_Occurred()
                                  ? PyDict_GetItemWithError(eh_obj, index_obj)
                                  : NULL;
                Py_DECREF(index_obj);
                if (PyErr_Occurred()) {
                    goto done;
                }
                if (per_carrier && (e == NULL || !as_u64(e, &eh))) {
                    goto fallback;
                }
            }
            if (put(&workers, &w, 4) < 0 || put(&tiers, &bits, 1) < 0 || put(&hashes, &eh, 8) < 0) {
                goto done;
            }
        }
        last = keys[j];
        has_last = 1;
        record++;
    }
    {
        PyObject *last_out = has_last ? PyLong_FromUnsignedLongLong(last) : Py_NewRef(last_obj);
        if (last_out == NULL) {
            goto done;
        }
        result = Py_BuildValue("(y#y#y#y#y#y#ON)", parents.buf ? parents.buf : "", parents.len,
                               out_keys.buf ? out_keys.buf : "", out_keys.len,
                               counts.buf ? counts.buf : "", counts.len,
                               workers.buf ? workers.buf : "", workers.len,
                               tiers.buf ? tiers.buf : "", tiers.len,
                               hashes.buf ? hashes.buf : "", hashes.len, branches, last_out);
    }
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(branches);
    PyMem_Free(parents.buf);
    PyMem_Free(out_keys.buf);
    PyMem_Free(counts.buf);
    PyMem_Free(workers.buf);
    PyMem_Free(tiers.buf);
    PyMem_Free(hashes.buf);
    PyBuffer_Release(&keys_c.view);
    return result;
}


/* ---- a prompt's path (twin: the lookups and masks of cachetree/tree.py prefix_depths) ---- */

/* path_held(nodes, keys) -> (held, tiered) | None
 *
 * held[i]: the ranks (a mask) holding every one of `keys`' blocks 0..i, for the leading blocks
 * the tree holds, up to the first it lacks or the first no rank holds with all before it
 * (nothing deeper can count); and whether any of those nodes has carriers off the device tier
 * alone (then the caller reads those nodes' tiers). The running AND is taken here: done in
 * Python it cost more than the lookups (a call to `and_` per block). A run of equal masks
 * shares one int; masks wider than 64 ranks are ANDed as ints. None when a node is not of the
 * native shape: the caller does the lookups itself. */
static PyObject *
py_path_held(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || Py_TYPE(args[0]) != &NodeMapType) {
        PyErr_SetString(PyExc_TypeError, "path_held(nodes: NodeMap, keys)");
        return NULL;
    }
    MapObject *nodes = (MapObject *)args[0];
    PyObject *seq = PySequence_Fast(args[1], "keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    PyObject **keys = PySequence_Fast_ITEMS(seq);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *held = PyList_New(0), *last = NULL, *result = NULL;
    U64Run run;
    run.v = run.local;
    uint64_t last_native = 0; /* `last`'s value while it fits 64 bits */
    int wide = 0;             /* `last` is an int wider than 64 bits */
    int tiered = 0;
    if (held == NULL) {
        goto done;
    }
    /* Past the first key that is no u64 the tree holds nothing of the prompt (no NodeMap
     * holds such a key): the walk stops there. */
    Py_ssize_t ok = u64_run(&run, keys, n);
    if (ok < 0) {
        goto done;
    }
    map_prefetch_start(nodes, run.v, ok);
    for (Py_ssize_t i = 0; i < ok && nodes->slots != NULL; i++) {
        map_prefetch_run(nodes, run.v, i, ok);
        const uint64_t key = run.v[i];
        Py_ssize_t slot, ix = map_find(nodes, key, &slot);
        if (ix < 0) {
            break;
        }
        PyObject *obj = (PyObject *)(uintptr_t)nodes->entries[ix].value;
        if (Py_TYPE(obj) != &NodeType) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        NodeObject *node = (NodeObject *)obj;
        if (native_mask(node) && !wide) {
            uint64_t value = last == NULL ? node->mask : last_native & node->mask;
            if (value == 0) {
                break;
            }
            if (last == NULL || value != last_native) {
                PyObject *mask = PyLong_FromUnsignedLongLong(value);
                if (mask == NULL) {
                    goto done;
                }
                Py_XSETREF(last, mask);
                last_native = value;
            }
        }
        else {
            PyObject *own = native_mask(node) ? PyLong_FromUnsignedLongLong(node->mask)
                                              : Py_NewRef(extra_of(node)->mask);
            if (own == NULL) {
                goto done;
            }
            PyObject *mask = last == NULL ? Py_NewRef(own) : PyNumber_And(last, own);
            Py_DECREF(own);
            if (mask == NULL) {
                goto done;
            }
            int empty = PyObject_Not(mask);
            if (empty != 0) {
                Py_DECREF(mask);
                if (empty < 0) {
                    goto done;
                }
                break;
            }
            Py_XSETREF(last, mask);
            wide = 1;
        }
        tiered |= node_tiers(node) != NULL;
        if (PyList_Append(held, last) < 0) {
            goto done;
        }
    }
    result = Py_BuildValue("(OO)", held, tiered ? Py_True : Py_False);
done:
    Py_XDECREF(last);
    Py_XDECREF(held);
    Py_DECREF(seq);
    u64_run_free(&run);
    return result;
}

/* pack_u64(keys, start) -> bytes: the u64s of keys[start:] (ints), native order, for
 * array('Q', ...) to copy: array's own conversion takes CPython's general path for every int
 * of more than one digit, which every block key is. ValueError at the first item that is not
 * a u64 int. (The pressure ledger lists each batch's keys so.) */
static PyObject *
py_pack_u64(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pack_u64(keys, start)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    start = start < 0 ? 0 : start > n ? n : start;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (n - start) * (Py_ssize_t)sizeof(uint64_t));
    if (out != NULL) {
        PyObject **items = PySequence_Fast_ITEMS(seq);
        uint64_t *v = (uint64_t *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = start; i < n; i++) {
            if (!as_u64(items[i], &v[i - start])) {
                PyErr_Format(PyExc_ValueError, "keys[%zd] is not an int in [0, 2**64)", i);
                Py_CLEAR(out);
                break;
            }
        }
    }
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"remove_run", (PyCFunction)(void (*)(void))py_remove_run, METH_FASTCALL,
     "remove_run(nodes, by_hash, hashes, start, index, device) -> (stop, found, dropped, "
     "unknown): cachetree.tree._remove_run_py over a NodeMap and a HashMap."},
    {"place_run", (PyCFunction)(void (*)(void))py_place_run, METH_FASTCALL,
     "place_run(nodes, by_hash, keys, hashes, start, parent_key, index) -> (stop, added): "
     "cachetree.tree._place_run_py over a NodeMap and a HashMap."},
    {"graft_new", (PyCFunction)(void (*)(void))py_graft_new, METH_FASTCALL,
     "graft_new(nodes, maps, index_of, keys, parents, counts, workers, hashes, new, a, b, c0) "
     "-> (code, record): SnapshotRestore's creation of new device-tier records."},
    {"pack_u64", (PyCFunction)(void (*)(void))py_pack_u64, METH_FASTCALL,
     "pack_u64(keys, start) -> bytes: keys[start:] as native u64s, for array('Q', ...)."},
    {"path_held", (PyCFunction)(void (*)(void))py_path_held, METH_FASTCALL,
     "path_held(nodes, keys) -> (held, tiered) | None: the lookups and running AND of "
     "prefix_depths."},
    {"walk_chunk", (PyCFunction)(void (*)(void))py_walk_chunk, METH_FASTCALL,
     "walk_chunk(nodes, keys, table, first, last_key) -> columns as bytes, branches, last key "
     "| None: SnapshotExport's walk of one listed chunk."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "cachetree._tables",
    "The block index's tables in C: Node, NodeMap, HashMap and the tree's runs over them.", -1,
    methods,
};

static int
random_seed(void)
{
    PyObject *os = PyImport_ImportModule("os");
    PyObject *raw = os ? PyObject_CallMethod(os, "urandom", "i", 8) : NULL;
    Py_XDECREF(os);
    if (raw == NULL) {
        return -1;
    }
    memcpy(&seed, PyBytes_AS_STRING(raw), sizeof(seed));
    Py_DECREF(raw);
    return 0;
}

PyMODINIT_FUNC
PyInit__tables(void)
{
    if (random_seed() < 0 || PyType_Ready(&NodeType) < 0 || PyType_Ready(&NodeMapType) < 0
        || PyType_Ready(&HashMapType) < 0 || PyType_Ready(&MapIterType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Node", (PyObject *)&NodeType) < 0
        || PyModule_AddObjectRef(m, "NodeMap", (PyObject *)&NodeMapType) < 0
        || PyModule_AddObjectRef(m, "HashMap", (PyObject *)&HashMapType) < 0
        || PyModule_AddIntConstant(m, "REHASH_STEP", REHASH_STEP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
