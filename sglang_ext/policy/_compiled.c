/* The admission forecast of a RequestTable, compiled: sglang_ext.policy.compiled.

   queue_forecast() is sglang_ext.policy.admission's forecast of a table's prefill queue
   (the rate, the queue in deadline order, Moore-Hodgson's eviction under `defer`, the
   EDF scan and its tables) in one call. Every float is the same IEEE operation, in the
   same order, on the same values as the Python reference, so the results are bit for bit
   its results (built with -ffp-contract=off: no fused multiply-adds); tests/policy/
   test_forecast_table.py checks it against the reference on every path. The columns are
   read through the buffer protocol (float64 and int64, any stride), so numpy is not a
   build dependency. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    const char *data;
    Py_ssize_t stride;
    int taken;
} Column;

static int column_take(Column *column, PyObject *array, char kind, Py_ssize_t rows,
                       const char *name) {
    if (PyObject_GetBuffer(array, &column->view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        return -1;
    }
    column->taken = 1;
    const char *format = column->view.format ? column->view.format : "B";
    char last = format[strlen(format) - 1];
    int matches = column->view.itemsize == 8 && column->view.ndim == 1
                  && (kind == 'd' ? last == 'd' : (last == 'l' || last == 'q'));
    if (!matches) {
        PyErr_Format(PyExc_TypeError, "column %s: expected a 1-d %s array", name,
                     kind == 'd' ? "float64" : "int64");
        return -1;
    }
    if (column->view.shape[0] != rows) {
        PyErr_Format(PyExc_ValueError, "column %s has %zd rows for %zd requests", name,
                     column->view.shape[0], rows);
        return -1;
    }
    column->data = (const char *)column->view.buf;
    column->stride = column->view.strides[0];
    return 0;
}

static void column_release(Column *column) {
    if (column->taken) {
        PyBuffer_Release(&column->view);
        column->taken = 0;
    }
}

static inline double as_double(const Column *column, Py_ssize_t row) {
    return *(const double *)(column->data + row * column->stride);
}

static inline int64_t as_int(const Column *column, Py_ssize_t row) {
    return *(const int64_t *)(column->data + row * column->stride);
}

/* RequestTable.due of one row: arrival + ttft + tpot * next_index, as numpy computes it. */
static inline double due_of(const Column *arrival, const Column *ttft, const Column *tpot,
                            const Column *next_index, Py_ssize_t row) {
    return as_double(arrival, row) + as_double(ttft, row)
           + as_double(tpot, row) * (double)as_int(next_index, row);
}

/* One queued prefill: _queue's entry (deadline, arrival number, work, KV need, started)
   and its row in the table. */
typedef struct {
    double deadline;
    int64_t seq;
    double work;
    double need;
    int started;
    Py_ssize_t row;
} Entry;

/* Python's ordering of floats in a sort: numpy puts NaN last. */
static inline int compare_doubles(double a, double b) {
    int a_nan = isnan(a), b_nan = isnan(b);
    if (a_nan || b_nan) {
        return a_nan - b_nan;
    }
    return (a > b) - (a < b);
}

/* np.lexsort((seq, due)) of the queued rows: deadline, then arrival number, then the row
   (lexsort is stable). */
static int by_deadline(const void *left, const void *right) {
    const Entry *a = (const Entry *)left, *b = (const Entry *)right;
    int order = compare_doubles(a->deadline, b->deadline);
    if (order) {
        return order;
    }
    if (a->seq != b->seq) {
        return a->seq < b->seq ? -1 : 1;
    }
    return (a->row > b->row) - (a->row < b->row);
}

/* _evicted's heap: the victim with the largest key first, ties to the latest position
   (Python's heap of (-key, -position) pops the same one). */
typedef struct {
    double key;
    Py_ssize_t position;
} Victim;

static inline int pops_before(const Victim *a, const Victim *b) {
    if (a->key != b->key) {
        return a->key > b->key;
    }
    return a->position > b->position;
}

static void heap_push(Victim *heap, Py_ssize_t *size, Victim victim) {
    Py_ssize_t at = (*size)++;
    while (at > 0) {
        Py_ssize_t parent = (at - 1) / 2;
        if (!pops_before(&victim, &heap[parent])) {
            break;
        }
        heap[at] = heap[parent];
        at = parent;
    }
    heap[at] = victim;
}

static Victim heap_pop(Victim *heap, Py_ssize_t *size) {
    Victim top = heap[0];
    Victim last = heap[--(*size)];
    Py_ssize_t at = 0, count = *size;
    for (;;) {
        Py_ssize_t child = 2 * at + 1;
        if (child >= count) {
            break;
        }
        if (child + 1 < count && pops_before(&heap[child + 1], &heap[child])) {
            child++;
        }
        if (!pops_before(&heap[child], &last)) {
            break;
        }
        heap[at] = heap[child];
        at = child;
    }
    if (count) {
        heap[at] = last;
    }
    return top;
}

/* 0 when a call got `expected` arguments, else -1 with a TypeError that names `name`. */
static int argument_count(Py_ssize_t nargs, Py_ssize_t expected, const char *name) {
    if (nargs == expected) {
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, expected, nargs);
    return -1;
}

/* The checks every call over a table starts with: its argument count, and its requests
   (the RequestTable, a list); their number in *rows. NULL on a wrong call. */
static PyObject *table_call(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected,
                            const char *name, Py_ssize_t *rows) {
    if (argument_count(nargs, expected, name) < 0) {
        return NULL;
    }
    if (!PyList_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "%s: requests must be a list (a RequestTable)", name);
        return NULL;
    }
    *rows = PyList_GET_SIZE(args[0]);
    return args[0];
}

/* The length of a 1-d buffer (a column), or -1 (then column_take refuses it). */
static Py_ssize_t column_length(PyObject *array) {
    Py_buffer view;
    if (PyObject_GetBuffer(array, &view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t length = view.ndim == 1 ? view.shape[0] : -1;
    PyBuffer_Release(&view);
    return length;
}

static const uint64_t FIBONACCI = 0x9E3779B97F4A7C15ULL;

/* admission.eviction_key's key of one entry. */
typedef struct {
    int kind; /* 0: longest (the work), 1: drawn (blind to length), 2: weighed */
    double weight, rest;
} EvictionKey;

static inline double eviction_key(const EvictionKey *key, int64_t seq, double work) {
    if (key->kind == 0) {
        return work;
    }
    uint64_t hashed = (uint64_t)seq * FIBONACCI;
    if (key->kind == 1) {
        return (double)hashed;
    }
    double draw = (double)hashed * 0x1p-64;
    return key->weight * log(1.0 > work ? 1.0 : work) - key->rest * log(1.0 - draw);
}

/* _evicted over entries[0..count): marks dropped[i]. Returns -1 on memory error. */
static int evict(const Entry *entries, Py_ssize_t count, const double *capacities,
                 const EvictionKey *key, char *dropped) {
    Py_ssize_t start = 0;
    while (start < count && entries[start].work > capacities[start]) {
        dropped[start++] = 1;
    }
    double work = 0.0;
    Py_ssize_t first_late = start;
    for (; first_late < count; first_late++) {
        double pending = entries[first_late].work;
        if (work + pending > capacities[first_late]) {
            break;
        }
        work += pending;
    }
    if (first_late == count) {
        return 0;
    }
    Victim *heap = PyMem_Malloc(sizeof(Victim) * (size_t)(count ? count : 1));
    if (heap == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t size = 0;
    for (Py_ssize_t position = start; position < first_late; position++) {
        if (!entries[position].started) {
            Victim victim = {eviction_key(key, entries[position].seq, entries[position].work),
                             position};
            heap_push(heap, &size, victim);
        }
    }
    for (Py_ssize_t position = first_late; position < count; position++) {
        double pending = entries[position].work;
        work += pending;
        if (!entries[position].started) {
            Victim victim = {eviction_key(key, entries[position].seq, pending), position};
            heap_push(heap, &size, victim);
        }
        double capacity = capacities[position];
        while (work > capacity && size) {
            Py_ssize_t victim = heap_pop(heap, &size).position;
            work -= entries[victim].work;
            dropped[victim] = 1;
        }
        if (work > capacity && !dropped[position]) {
            work -= pending;
            dropped[position] = 1;
        }
    }
    PyMem_Free(heap);
    return 0;
}

/* KvOutlook, read once: free tokens, releases (ascending times, cumulative tokens). */
typedef struct {
    double free_tokens;
    Py_ssize_t releases;
    double *release_times;
    double *released_through;
} Outlook;

static double available_at(const Outlook *kv, double time_s) {
    /* bisect_right(release_times, time_s) */
    Py_ssize_t low = 0, high = kv->releases;
    while (low < high) {
        Py_ssize_t middle = (low + high) / 2;
        if (time_s < kv->release_times[middle]) {
            high = middle;
        } else {
            low = middle + 1;
        }
    }
    return kv->free_tokens + (low ? kv->released_through[low - 1] : 0.0);
}

static int doubles_of(PyObject *sequence, Py_ssize_t count, double *out, const char *name) {
    PyObject *fast = PySequence_Fast(sequence, name);
    if (fast == NULL) {
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(fast) != count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd values, expected %zd", name,
                     PySequence_Fast_GET_SIZE(fast), count);
        Py_DECREF(fast);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < count; i++) {
        out[i] = PyFloat_AsDouble(items[i]);
        if (out[i] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

/* _suffix_minima: out[i] = min(values[i:]), one longer (its last is inf), as a tuple. */
static PyObject *suffix_minima(const double *values, Py_ssize_t count) {
    PyObject *out = PyTuple_New(count + 1);
    if (out == NULL) {
        return NULL;
    }
    double smallest = INFINITY;
    for (Py_ssize_t i = count; i >= 0; i--) {
        if (i < count) {
            double value = values[i];
            smallest = smallest < value ? smallest : value; /* min(value, smallest) */
        }
        PyObject *item = PyFloat_FromDouble(smallest);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *tuple_of(const double *values, Py_ssize_t count) {
    PyObject *out = PyTuple_New(count);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyFloat_FromDouble(values[i]);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *REQ_ID, *GET;

static PyObject *request_id(PyObject *requests, Py_ssize_t row) {
    return PyObject_GetAttr(PyList_GET_ITEM(requests, row), REQ_ID);
}

static int add_hopeless(PyObject *hopeless, PyObject *requests, Py_ssize_t row) {
    PyObject *req_id = request_id(requests, row);
    if (req_id == NULL) {
        return -1;
    }
    int status = PySet_Add(hopeless, req_id);
    Py_DECREF(req_id);
    return status;
}

static double number(PyObject *value, int *failed) {
    double out = PyFloat_AsDouble(value);
    if (out == -1.0 && PyErr_Occurred()) {
        *failed = 1;
    }
    return out;
}

enum {
    ARG_REQUESTS, ARG_ARRIVAL, ARG_TTFT, ARG_NEXT_INDEX, ARG_SEQ, ARG_PENDING, ARG_CONTEXT,
    ARG_PROMPT, ARG_TPOT,
    ARG_NOW, ARG_DEFAULT_TPOT, ARG_A, ARG_B, ARG_HEADROOM, ARG_FIXED, ARG_PER_KV, ARG_SCALE,
    ARG_KNEE, ARG_WORK_C, ARG_WORK_E, ARG_LENGTH_WEIGHT, ARG_KV, ARG_WITH_TABLES,
    ARGS
};

PyDoc_STRVAR(queue_forecast_doc,
"queue_forecast(requests, arrival, ttft, next_index, seq, pending, context, prompt, tpot,\n"
"               now, default_tpot_s,\n"
"               a_s, b_s_per_token, headroom, fixed, per_kv_token, scale, knee_tokens,\n"
"               work_c, work_e, length_weight, kv, with_tables)\n"
"--\n\n"
"The admission forecast of a table (sglang_ext.policy.admission._compiled_forecast\n"
"says what each argument is). Returns (rate, hopeless request ids) and, with tables,\n"
"(deadlines, work_through, spare_after, need_through, kv_spare_after) after them.");

static PyObject *queue_forecast(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t rows;
    PyObject *requests = table_call(args, nargs, ARGS, "queue_forecast", &rows);
    if (requests == NULL) {
        return NULL;
    }
    int failed = 0;
    double now = number(args[ARG_NOW], &failed);
    double default_tpot = number(args[ARG_DEFAULT_TPOT], &failed);
    double a_s = number(args[ARG_A], &failed);
    double b = number(args[ARG_B], &failed);
    double headroom = number(args[ARG_HEADROOM], &failed);
    double fixed = number(args[ARG_FIXED], &failed);
    double per_kv = number(args[ARG_PER_KV], &failed);
    double scale = number(args[ARG_SCALE], &failed);
    int knee = args[ARG_KNEE] != Py_None;
    double knee_tokens = knee ? number(args[ARG_KNEE], &failed) : 0.0;
    double work_c = knee ? number(args[ARG_WORK_C], &failed) : 0.0;
    double work_e = knee ? number(args[ARG_WORK_E], &failed) : 0.0;
    int evicting = args[ARG_LENGTH_WEIGHT] != Py_None;
    double length_weight = evicting ? number(args[ARG_LENGTH_WEIGHT], &failed) : 0.0;
    int with_tables = PyObject_IsTrue(args[ARG_WITH_TABLES]);
    if (failed || with_tables < 0) {
        return NULL;
    }
    PyObject *kv_args = args[ARG_KV];
    int with_kv = kv_args != Py_None;
    PyObject *reserves = NULL;
    double new_reserve = 0.0;
    Outlook kv = {0.0, 0, NULL, NULL};

    Column arrival = {0}, ttft = {0}, next_index = {0}, seq = {0}, pending = {0}, context = {0},
           prompt = {0}, tpot = {0};
    Entry *entries = NULL;
    double *capacities = NULL, *kept_table = NULL;
    char *dropped = NULL;
    PyObject *hopeless = NULL, *result = NULL;

    if (column_take(&arrival, args[ARG_ARRIVAL], 'd', rows, "arrival") < 0
        || column_take(&ttft, args[ARG_TTFT], 'd', rows, "ttft") < 0
        || column_take(&next_index, args[ARG_NEXT_INDEX], 'q', rows, "next_index") < 0
        || column_take(&seq, args[ARG_SEQ], 'q', rows, "seq") < 0
        || column_take(&pending, args[ARG_PENDING], 'q', rows, "pending") < 0
        || column_take(&context, args[ARG_CONTEXT], 'q', rows, "context") < 0
        || column_take(&prompt, args[ARG_PROMPT], 'q', rows, "prompt") < 0
        || column_take(&tpot, args[ARG_TPOT], 'd', rows, "tpot") < 0) {
        goto done;
    }
    Py_ssize_t queued = 0;
    for (Py_ssize_t row = 0; row < rows; row++) {
        queued += as_int(&pending, row) != 0;
    }
    if (with_kv && queued) {
        PyObject *times, *through;
        double free_tokens;
        if (!PyArg_ParseTuple(kv_args, "dOOOd;kv must be (free_tokens, release_times, "
                              "released_through, reserves, new_reserve)",
                              &free_tokens, &times, &through, &reserves, &new_reserve)) {
            goto done;
        }
        kv.free_tokens = free_tokens;
        kv.releases = PyObject_Length(times);
        if (kv.releases < 0) {
            goto done;
        }
        kv.release_times = PyMem_Malloc(sizeof(double) * (size_t)(2 * kv.releases + 1));
        if (kv.release_times == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        kv.released_through = kv.release_times + kv.releases;
        if (doubles_of(times, kv.releases, kv.release_times, "release_times") < 0
            || doubles_of(through, kv.releases, kv.released_through, "released_through") < 0) {
            goto done;
        }
    }

    /* the rate: prefill_rate's sum over every request, in the table's order */
    double period = default_tpot;
    double decode_share = 0.0;
    for (Py_ssize_t row = 0; row < rows; row++) {
        double request_tpot = as_double(&tpot, row);
        if (request_tpot < period) {
            period = request_tpot;
        }
        int64_t request_pending = as_int(&pending, row);
        decode_share += (fixed + per_kv * (double)(as_int(&context, row) + request_pending) * scale)
                        / request_tpot;
    }
    double free_share = 1.0 - a_s / period - decode_share;
    double rate = (free_share > 0.0 ? free_share : 0.0) / b * (1.0 - headroom);

    /* the queue, in deadline order */
    size_t slots = (size_t)(queued ? queued : 1);
    entries = PyMem_Malloc(sizeof(Entry) * slots);
    capacities = PyMem_Malloc(sizeof(double) * slots);
    dropped = PyMem_Calloc(slots, 1);
    kept_table = PyMem_Malloc(sizeof(double) * slots * 5);
    hopeless = PySet_New(NULL);
    if (entries == NULL || capacities == NULL || dropped == NULL || kept_table == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (hopeless == NULL) {
        goto done;
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t row = 0; row < rows; row++) {
        int64_t request_pending = as_int(&pending, row);
        if (request_pending == 0) {
            continue;
        }
        Entry *entry = &entries[count++];
        int64_t request_context = as_int(&context, row);
        entry->deadline = due_of(&arrival, &ttft, &tpot, &next_index, row);
        entry->seq = as_int(&seq, row);
        entry->row = row;
        entry->started = request_pending < as_int(&prompt, row);
        if (knee) { /* prefill_cost_s(pending, context, knee_tokens) / b */
            double after = knee_tokens + (double)request_pending;
            if (after < knee_tokens) {
                after = knee_tokens;
            }
            entry->work = (b * (after - knee_tokens) + work_c * (double)request_context
                           + work_e * (double)request_pending
                                 * ((double)request_context + (double)(request_pending + 1) / 2.0))
                          / b;
        } else {
            entry->work = (double)request_pending;
        }
        entry->need = 0.0;
    }
    qsort(entries, (size_t)count, sizeof(Entry), by_deadline);
    if (with_kv) {
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *req_id = request_id(requests, entries[i].row);
            if (req_id == NULL) {
                goto done;
            }
            PyObject *reserve;
            if (PyDict_CheckExact(reserves)) {
                reserve = PyDict_GetItemWithError(reserves, req_id);
                if (reserve == NULL && PyErr_Occurred()) {
                    Py_DECREF(req_id);
                    goto done;
                }
                Py_XINCREF(reserve);
            } else {
                reserve = PyObject_CallMethodObjArgs(reserves, GET, req_id, Py_None, NULL);
                if (reserve == NULL) {
                    Py_DECREF(req_id);
                    goto done;
                }
                if (reserve == Py_None) {
                    Py_CLEAR(reserve);
                }
            }
            Py_DECREF(req_id);
            double reserved = new_reserve;
            if (reserve != NULL) {
                reserved = PyFloat_AsDouble(reserve);
                Py_DECREF(reserve);
                if (reserved == -1.0 && PyErr_Occurred()) {
                    goto done;
                }
            }
            entries[i].need = (double)as_int(&pending, entries[i].row) + reserved;
        }
    }

    int all_need_work = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        capacities[i] = rate * (entries[i].deadline - now);
        all_need_work &= entries[i].work > 0.0;
    }
    if (rate <= 0.0 && all_need_work) {
        /* no prefill rate left: every queued prefill is late */
        for (Py_ssize_t i = 0; i < count; i++) {
            if (add_hopeless(hopeless, requests, entries[i].row) < 0) {
                goto done;
            }
        }
        count = 0;
    } else if (evicting) {
        EvictionKey key = {2, length_weight, 1.0 - length_weight};
        if (length_weight >= 1.0) {
            key.kind = 0;
        } else if (length_weight <= 0.0) {
            key.kind = 1;
        }
        if (evict(entries, count, capacities, &key, dropped) < 0) {
            goto done;
        }
        Py_ssize_t kept = 0;
        for (Py_ssize_t i = 0; i < count; i++) {
            if (dropped[i]) {
                if (add_hopeless(hopeless, requests, entries[i].row) < 0) {
                    goto done;
                }
            } else {
                entries[kept] = entries[i];
                capacities[kept++] = capacities[i];
            }
        }
        count = kept;
    }

    /* the EDF scan */
    double *deadlines = kept_table, *work_through = kept_table + slots,
           *spares = kept_table + 2 * slots, *need_through = kept_table + 3 * slots,
           *kv_spares = kept_table + 4 * slots;
    Py_ssize_t feasible = 0;
    double work = 0.0, needed = 0.0;
    for (Py_ssize_t i = 0; i < count; i++) {
        const Entry *entry = &entries[i];
        double capacity = capacities[i];
        if (work + entry->work > capacity) {
            if (add_hopeless(hopeless, requests, entry->row) < 0) {
                goto done;
            }
            continue;
        }
        if (with_kv) {
            double kv_spare = available_at(&kv, entry->deadline - entry->work / rate) - needed
                              - entry->need;
            if (kv_spare < 0) {
                if (add_hopeless(hopeless, requests, entry->row) < 0) {
                    goto done;
                }
                continue;
            }
            needed += entry->need;
            need_through[feasible] = needed;
            kv_spares[feasible] = kv_spare;
        }
        work += entry->work;
        deadlines[feasible] = entry->deadline;
        work_through[feasible] = work;
        spares[feasible] = capacity - work;
        feasible++;
    }

    PyObject *ids = PyFrozenSet_New(hopeless);
    if (ids == NULL) {
        goto done;
    }
    if (!with_tables) {
        result = Py_BuildValue("(dN)", rate, ids);
        goto done;
    }
    PyObject *empty = PyTuple_New(0);
    result = Py_BuildValue(
        "(dNNNNNN)", rate, ids, tuple_of(deadlines, feasible), tuple_of(work_through, feasible),
        suffix_minima(spares, feasible),
        with_kv ? tuple_of(need_through, feasible) : (Py_XINCREF(empty), empty),
        with_kv ? suffix_minima(kv_spares, feasible) : (Py_XINCREF(empty), empty));
    Py_XDECREF(empty);

done:
    column_release(&arrival);
    column_release(&ttft);
    column_release(&next_index);
    column_release(&seq);
    column_release(&pending);
    column_release(&context);
    column_release(&prompt);
    column_release(&tpot);
    PyMem_Free(kv.release_times);
    PyMem_Free(entries);
    PyMem_Free(capacities);
    PyMem_Free(dropped);
    PyMem_Free(kept_table);
    Py_XDECREF(hopeless);
    return result;
}

/* A row and its sort key (a float, or an arrival number), for numpy's stable argsort of
   rows given in increasing order: by key (a float's NaN last), ties by row. */
typedef struct {
    double key;
    int64_t seq;
    Py_ssize_t row;
} Keyed;

static inline int by_key(const Keyed *a, const Keyed *b) {
    int order = compare_doubles(a->key, b->key);
    return order ? order < 0 : a->row < b->row;
}

static inline int by_seq(const Keyed *a, const Keyed *b) {
    return a->seq != b->seq ? a->seq < b->seq : a->row < b->row;
}

/* A merge sort of items[0..count) by a total order (so stable whatever the algorithm);
   scratch holds as many. Runs of 8 by insertion first. */
#define DEFINE_SORT(name, Item, before)                                                          \
    static void name(Item *items, Item *scratch, Py_ssize_t count) {                     \
        for (Py_ssize_t start = 0; start < count; start += 8) {                            \
            Py_ssize_t end = start + 8 < count ? start + 8 : count;                        \
            for (Py_ssize_t i = start + 1; i < end; i++) {                                 \
                Item item = items[i];                                                      \
                Py_ssize_t j = i;                                                          \
                while (j > start && before(&item, &items[j - 1])) {                        \
                    items[j] = items[j - 1];                                               \
                    j--;                                                                   \
                }                                                                          \
                items[j] = item;                                                           \
            }                                                                              \
        }                                                                                  \
        Item *from = items, *to = scratch;                                                 \
        for (Py_ssize_t width = 8; width < count; width *= 2) {                            \
            for (Py_ssize_t left = 0; left < count; left += 2 * width) {                   \
                Py_ssize_t middle = left + width < count ? left + width : count;           \
                Py_ssize_t right = left + 2 * width < count ? left + 2 * width : count;    \
                Py_ssize_t i = left, j = middle, k = left;                                 \
                while (i < middle && j < right) {                                          \
                    to[k++] = before(&from[j], &from[i]) ? from[j++] : from[i++];          \
                }                                                                          \
                while (i < middle) {                                                       \
                    to[k++] = from[i++];                                                   \
                }                                                                          \
                while (j < right) {                                                        \
                    to[k++] = from[j++];                                                   \
                }                                                                          \
            }                                                                              \
            Item *swap = from;                                                             \
            from = to;                                                                     \
            to = swap;                                                                     \
        }                                                                                  \
        if (from != items) {                                                               \
            memcpy(items, from, sizeof(Item) * (size_t)count);                             \
        }                                                                                  \
    }

DEFINE_SORT(sort_by_key, Keyed, by_key)
DEFINE_SORT(sort_by_seq, Keyed, by_seq)

/* A running request's KV release: when, how many tokens, its place (np.lexsort((tokens,
   times)) orders by time, then tokens, then place). */
typedef struct {
    double time;
    double tokens;
    Py_ssize_t index;
} Release;

static inline int release_before(const Release *a, const Release *b) {
    int order = compare_doubles(a->time, b->time);
    if (order) {
        return order < 0;
    }
    order = compare_doubles(a->tokens, b->tokens);
    return order ? order < 0 : a->index < b->index;
}

static inline int int_before(const int64_t *a, const int64_t *b) {
    return *a < *b;
}

DEFINE_SORT(sort_releases, Release, release_before)
DEFINE_SORT(sort_ints, int64_t, int_before)

static int writable_column(Column *column, PyObject *array, char kind, Py_ssize_t rows,
                           const char *name) {
    if (PyObject_GetBuffer(array, &column->view,
                           PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    column->taken = 1;
    const char *format = column->view.format ? column->view.format : "B";
    char last = format[strlen(format) - 1];
    int matches = column->view.itemsize == 8 && column->view.ndim == 1
                  && column->view.shape[0] == rows
                  && (kind == 'd' ? last == 'd' : (last == 'l' || last == 'q'));
    if (!matches) {
        PyErr_Format(PyExc_TypeError, "%s: expected a writable 1-d %s array of %zd rows",
                     name, kind == 'd' ? "float64" : "intp", rows);
        return -1;
    }
    column->data = (const char *)column->view.buf;
    column->stride = 8;
    return 0;
}

enum {
    TRIAGE_REQUESTS, TRIAGE_ARRIVAL, TRIAGE_TTFT, TRIAGE_TPOT, TRIAGE_PENDING, TRIAGE_CONTEXT,
    TRIAGE_SEQ, TRIAGE_NEXT_INDEX,
    TRIAGE_FIRST, TRIAGE_NOW, TRIAGE_ANCHORED, TRIAGE_FLOOR, TRIAGE_HOPELESS, TRIAGE_GUARD,
    TRIAGE_SLACK_OUT, TRIAGE_ROWS_OUT, TRIAGE_ARGS
};

PyDoc_STRVAR(triage_doc,
"triage(requests, arrival, ttft, tpot, pending, context, seq, next_index, first, now,\n"
"       anchored, floor,\n"
"       hopeless, deadline_guard_s, slack_out, rows_out)\n"
"--\n\n"
"FairBatching's triage of a table (sglang_ext.policy.row_groups._compiled_triage says\n"
"what each argument is). Fills slack_out with each row's slack (less the guard where in\n"
"time) and rows_out with the in-time decodes, then the in-time prefills, by slack, then\n"
"the late decodes and the late prefills in arrival order. Returns (init_time_budget_s,\n"
"min_tpot_s, late_decode_tpot_s, urgent decodes, in-time decodes, in-time prefills,\n"
"late decodes, the decoding requests' context).");

static PyObject *triage(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t rows;
    PyObject *requests = table_call(args, nargs, TRIAGE_ARGS, "triage", &rows);
    if (requests == NULL) {
        return NULL;
    }
    int failed = 0;
    double now = number(args[TRIAGE_NOW], &failed);
    double guard = number(args[TRIAGE_GUARD], &failed);
    int anchored = PyObject_IsTrue(args[TRIAGE_ANCHORED]);
    PyObject *hopeless = args[TRIAGE_HOPELESS];
    int has_hopeless = PyObject_IsTrue(hopeless);
    PyObject *floor_args = args[TRIAGE_FLOOR];
    int has_floor = floor_args != Py_None;
    double serviceable = -INFINITY, fallback_budget = 0.0, min_budget = 0.0;
    if (failed || anchored < 0 || has_hopeless < 0) {
        return NULL;
    }
    if (has_floor && !PyArg_ParseTuple(floor_args, "ddd;floor must be (min_serviceable_tpot_s, "
                                       "fallback_budget_s, min_budget_s)",
                                       &serviceable, &fallback_budget, &min_budget)) {
        return NULL;
    }
    if (has_hopeless && !PyAnySet_Check(hopeless)) {
        PyErr_SetString(PyExc_TypeError, "hopeless must be a set of request ids");
        return NULL;
    }

    Column arrival = {0}, ttft = {0}, tpot = {0}, pending = {0}, context = {0}, seq = {0},
           next_index = {0}, first = {0};
    Column slack_out = {0}, rows_out = {0};
    Keyed *in_time = NULL;
    char *late = NULL;
    PyObject *result = NULL;
    if (column_take(&arrival, args[TRIAGE_ARRIVAL], 'd', rows, "arrival") < 0
        || column_take(&ttft, args[TRIAGE_TTFT], 'd', rows, "ttft") < 0
        || column_take(&tpot, args[TRIAGE_TPOT], 'd', rows, "tpot") < 0
        || column_take(&pending, args[TRIAGE_PENDING], 'q', rows, "pending") < 0
        || column_take(&context, args[TRIAGE_CONTEXT], 'q', rows, "context") < 0
        || column_take(&seq, args[TRIAGE_SEQ], 'q', rows, "seq") < 0
        || column_take(&next_index, args[TRIAGE_NEXT_INDEX], 'q', rows, "next_index") < 0
        || column_take(&first, args[TRIAGE_FIRST], 'd', rows, "first") < 0
        || writable_column(&slack_out, args[TRIAGE_SLACK_OUT], 'd', rows, "slack_out") < 0
        || writable_column(&rows_out, args[TRIAGE_ROWS_OUT], 'q', rows, "rows_out") < 0) {
        goto done;
    }
    double *slack = (double *)slack_out.view.buf;
    Py_ssize_t *order = (Py_ssize_t *)rows_out.view.buf;
    size_t slots = (size_t)(rows ? rows : 1);
    in_time = PyMem_Malloc(sizeof(Keyed) * slots * 2);
    late = PyMem_Calloc(slots, 1);
    if (in_time == NULL || late == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Keyed *scratch = in_time + slots;

    /* slack, and who is late: past the deadline or under the serviceable TPOT (with a
       floor), or a queued prefill the forecast gave up */
    long long decoding_context = 0;
    for (Py_ssize_t row = 0; row < rows; row++) {
        double deadline = due_of(&arrival, &ttft, &tpot, &next_index, row);
        if (as_int(&pending, row) == 0) {
            decoding_context += as_int(&context, row);
        }
        if (anchored) { /* after a first token its deadline is first + tpot * j */
            int64_t index = as_int(&next_index, row);
            double first_time = as_double(&first, row);
            if (index != 0 && !isnan(first_time)) {
                deadline = first_time + as_double(&tpot, row) * (double)index;
            }
        }
        slack[row] = deadline - now;
        if (has_floor) {
            late[row] = slack[row] < 0.0 || as_double(&tpot, row) < serviceable;
        }
        if (has_hopeless && !late[row] && as_int(&pending, row) != 0) {
            PyObject *req_id = request_id(requests, row);
            if (req_id == NULL) {
                goto done;
            }
            int given_up = PySet_Contains(hopeless, req_id);
            Py_DECREF(req_id);
            if (given_up < 0) {
                goto done;
            }
            late[row] = (char)given_up;
        }
    }
    Py_ssize_t in_time_count = 0, late_count = 0;
    for (Py_ssize_t row = 0; row < rows; row++) {
        if (late[row]) {
            late_count++;
            continue;
        }
        if (guard != 0.0) {
            slack[row] = slack[row] - guard;
        }
        in_time[in_time_count].key = slack[row];
        in_time[in_time_count++].row = row;
    }
    sort_by_key(in_time, scratch, in_time_count);
    double min_slack = in_time_count ? slack[in_time[0].row] : 0.0;

    /* the in-time decodes, then the in-time prefills, by slack */
    Py_ssize_t decodes = 0;
    double min_tpot = INFINITY;
    for (Py_ssize_t i = 0; i < in_time_count; i++) {
        Py_ssize_t row = in_time[i].row;
        double request_tpot = as_double(&tpot, row);
        if (request_tpot < min_tpot || isnan(request_tpot)) {
            min_tpot = request_tpot; /* np.minimum propagates NaN */
        }
        if (as_int(&pending, row) == 0) {
            order[decodes++] = row;
        }
    }
    Py_ssize_t prefills = decodes;
    for (Py_ssize_t i = 0; i < in_time_count; i++) {
        Py_ssize_t row = in_time[i].row;
        if (as_int(&pending, row) != 0) {
            order[prefills++] = row;
        }
    }

    /* the late ones in arrival order: decodes, then prefills */
    Py_ssize_t late_decodes = prefills, late_total = 0;
    double late_tpot = INFINITY;
    if (late_count) {
        Keyed *late_rows = in_time; /* the in-time order is in rows_out now */
        for (Py_ssize_t row = 0; row < rows; row++) {
            if (late[row]) {
                late_rows[late_total].seq = as_int(&seq, row);
                late_rows[late_total++].row = row;
            }
        }
        sort_by_seq(late_rows, scratch, late_total);
        for (Py_ssize_t i = 0; i < late_total; i++) {
            Py_ssize_t row = late_rows[i].row;
            if (as_int(&pending, row) == 0) {
                order[late_decodes++] = row;
                double request_tpot = as_double(&tpot, row); /* np.maximum(tpot, serviceable) */
                double served = isnan(request_tpot) || request_tpot >= serviceable
                                ? request_tpot : serviceable;
                if (served < late_tpot || isnan(served)) {
                    late_tpot = served;
                }
            }
        }
        Py_ssize_t late_prefills = late_decodes;
        for (Py_ssize_t i = 0; i < late_total; i++) {
            Py_ssize_t row = late_rows[i].row;
            if (as_int(&pending, row) != 0) {
                order[late_prefills++] = row;
            }
        }
    }

    /* batch_former.initial_time_budget */
    double init_time_budget;
    if (min_tpot == INFINITY) { /* nobody in time */
        init_time_budget = has_floor ? fallback_budget : INFINITY;
    } else {
        double lowest = min_tpot - guard;
        if (has_floor && lowest < min_budget) {
            lowest = min_tpot < min_budget ? min_tpot : min_budget;
        }
        init_time_budget = lowest > min_slack ? lowest : min_slack; /* max(min_slack, lowest) */
    }
    if (late_tpot < init_time_budget) {
        init_time_budget = late_tpot;
    }
    /* searchsorted(slack of the in-time decodes, init + min_tpot, side="left") */
    double threshold = init_time_budget + min_tpot;
    Py_ssize_t urgent = 0, above = decodes;
    while (urgent < above) {
        Py_ssize_t middle = (urgent + above) / 2;
        if (compare_doubles(slack[order[middle]], threshold) < 0) {
            urgent = middle + 1;
        } else {
            above = middle;
        }
    }
    result = Py_BuildValue("(dddnnnnL)", init_time_budget, min_tpot, late_tpot, urgent, decodes,
                           prefills, late_decodes, decoding_context);

done:
    column_release(&arrival);
    column_release(&ttft);
    column_release(&tpot);
    column_release(&pending);
    column_release(&context);
    column_release(&seq);
    column_release(&next_index);
    column_release(&first);
    column_release(&slack_out);
    column_release(&rows_out);
    PyMem_Free(in_time);
    PyMem_Free(late);
    return result;
}

static int bool_column(Column *column, PyObject *array, const char *name) {
    if (PyObject_GetBuffer(array, &column->view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        return -1;
    }
    column->taken = 1;
    const char *format = column->view.format ? column->view.format : "B";
    if (column->view.itemsize != 1 || column->view.ndim != 1
        || format[strlen(format) - 1] != '?') {
        PyErr_Format(PyExc_TypeError, "column %s: expected a 1-d bool array", name);
        return -1;
    }
    column->data = (const char *)column->view.buf;
    column->stride = column->view.strides[0];
    return 0;
}

enum {
    KV_FREE, KV_RATIO, KV_CLIP, KV_DECODING, KV_QUEUED_FROM, KV_STORE_ROWS, KV_MAX_NEW,
    KV_IGNORE_EOS, KV_OUTPUTS, KV_FIRST, KV_ARRIVAL, KV_TTFT, KV_TPOT, KV_CONTEXT, KV_ARGS
};

PyDoc_STRVAR(kv_outlook_doc,
"kv_outlook(free_and_evictable, new_token_ratio, clip, decoding, queued_from, store_rows,\n"
"           max_new, ignore_eos, outputs, first, arrival, ttft, tpot, context)\n"
"--\n\n"
"The KV outlook of a decision's table (sglang_ext.adapter.scheduler.kv_outlook.\n"
"kv_outlook_of_table says what each argument is). Returns (free tokens, release times,\n"
"released through, the queued requests' output reserves, new_reserve).");

static PyObject *kv_outlook(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (argument_count(nargs, KV_ARGS, "kv_outlook") < 0) {
        return NULL;
    }
    int failed = 0;
    double free_tokens = number(args[KV_FREE], &failed);
    double ratio = number(args[KV_RATIO], &failed);
    int64_t clip = PyLong_AsLongLong(args[KV_CLIP]);
    Py_ssize_t decoding = PyLong_AsSsize_t(args[KV_DECODING]);
    Py_ssize_t queued_from = PyLong_AsSsize_t(args[KV_QUEUED_FROM]);
    if (failed || PyErr_Occurred()) {
        return NULL;
    }
    PyObject *outputs = args[KV_OUTPUTS];
    if (!PyList_Check(outputs)) {
        PyErr_SetString(PyExc_TypeError, "outputs must be a list of ints");
        return NULL;
    }
    Py_ssize_t rows = PyList_GET_SIZE(outputs);
    if (decoding < 0 || decoding > rows || queued_from < decoding || queued_from > rows) {
        PyErr_SetString(PyExc_ValueError, "decoding and queued_from must split the rows");
        return NULL;
    }
    Column store_rows = {0}, max_new = {0}, ignore_eos = {0}, first = {0}, arrival = {0},
           ttft = {0}, tpot = {0}, context = {0};
    Release *releases = NULL;
    int64_t *initial = NULL;
    PyObject *result = NULL, *whole_queued = NULL, *times = NULL, *through = NULL;
    if (column_take(&store_rows, args[KV_STORE_ROWS], 'q', rows, "store_rows") < 0
        || column_take(&first, args[KV_FIRST], 'd', rows, "first") < 0
        || column_take(&arrival, args[KV_ARRIVAL], 'd', rows, "arrival") < 0
        || column_take(&ttft, args[KV_TTFT], 'd', rows, "ttft") < 0
        || column_take(&tpot, args[KV_TPOT], 'd', rows, "tpot") < 0
        || column_take(&context, args[KV_CONTEXT], 'q', rows, "context") < 0) {
        goto done;
    }
    if (PyObject_GetBuffer(args[KV_MAX_NEW], &max_new.view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        goto done;
    }
    max_new.taken = 1;
    const char *format = max_new.view.format ? max_new.view.format : "B";
    char last = format[strlen(format) - 1];
    if (max_new.view.itemsize != 8 || max_new.view.ndim != 1 || (last != 'l' && last != 'q')) {
        PyErr_SetString(PyExc_TypeError, "column max_new: expected a 1-d int64 array");
        goto done;
    }
    max_new.data = (const char *)max_new.view.buf;
    max_new.stride = max_new.view.strides[0];
    if (bool_column(&ignore_eos, args[KV_IGNORE_EOS], "ignore_eos") < 0) {
        goto done;
    }
    if (ignore_eos.view.shape[0] != max_new.view.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "max_new and ignore_eos are store columns of one length");
        goto done;
    }
    Py_ssize_t store_size = max_new.view.shape[0];
    size_t slots = (size_t)(rows ? rows : 1);
    releases = PyMem_Malloc(sizeof(Release) * slots * 2);
    initial = PyMem_Malloc(sizeof(int64_t) * slots * 2);
    whole_queued = PyList_New(rows - queued_from);
    if (releases == NULL || initial == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (whole_queued == NULL) {
        goto done;
    }
    Py_ssize_t initials = 0;
    for (Py_ssize_t row = 0; row < rows; row++) {
        if (row >= decoding && row < queued_from) {
            continue; /* the cut prompt: the caller charges it */
        }
        Py_ssize_t store_row = (Py_ssize_t)as_int(&store_rows, row);
        if (store_row < 0 || store_row >= store_size) {
            PyErr_SetString(PyExc_IndexError, "a store row out of the store");
            goto done;
        }
        int64_t request_max_new = as_int(&max_new, store_row);
        int64_t produced = PyLong_AsLongLong(PyList_GET_ITEM(outputs, row));
        if (produced == -1 && PyErr_Occurred()) {
            goto done;
        }
        int64_t remaining = request_max_new - produced;
        if (remaining < 0) {
            remaining = 0;
        }
        int64_t whole = remaining < clip ? remaining : clip;
        int64_t reserved_at_start = request_max_new > 0 ? request_max_new : 0;
        initial[initials++] = reserved_at_start < clip ? reserved_at_start : clip;
        if (row >= queued_from) {
            PyObject *item = PyFloat_FromDouble((double)whole);
            if (item == NULL) {
                goto done;
            }
            PyList_SET_ITEM(whole_queued, row - queued_from, item);
            continue;
        }
        double reserve = (double)whole
                         * (*(const char *)(ignore_eos.data + store_row * ignore_eos.stride)
                            ? 1.0 : ratio);
        free_tokens -= reserve;
        double first_time = as_double(&first, row);
        double anchor = isnan(first_time) ? as_double(&arrival, row) + as_double(&ttft, row)
                                          : first_time;
        int64_t later = request_max_new - 1;
        releases[row].time = anchor + (double)(later > 0 ? later : 0) * as_double(&tpot, row);
        releases[row].tokens = (double)as_int(&context, row) + reserve;
        releases[row].index = row;
    }
    sort_releases(releases, releases + slots, decoding);
    sort_ints(initial, initial + slots, initials);
    double new_reserve = 0.0;
    if (initials) { /* statistics.median */
        Py_ssize_t middle = initials / 2;
        new_reserve = initials % 2 ? (double)initial[middle]
                                   : (double)(initial[middle - 1] + initial[middle]) / 2.0;
    }
    times = PyTuple_New(decoding);
    through = PyTuple_New(decoding);
    if (times == NULL || through == NULL) {
        goto done;
    }
    double total = 0.0;
    for (Py_ssize_t i = 0; i < decoding; i++) {
        total = i ? total + releases[i].tokens : releases[i].tokens;
        PyObject *time_item = PyFloat_FromDouble(releases[i].time);
        PyObject *total_item = PyFloat_FromDouble(total);
        if (time_item == NULL || total_item == NULL) {
            Py_XDECREF(time_item);
            Py_XDECREF(total_item);
            goto done;
        }
        PyTuple_SET_ITEM(times, i, time_item);
        PyTuple_SET_ITEM(through, i, total_item);
    }
    result = Py_BuildValue("(dOOOd)", free_tokens, times, through, whole_queued, new_reserve);

done:
    column_release(&store_rows);
    column_release(&max_new);
    column_release(&ignore_eos);
    column_release(&first);
    column_release(&arrival);
    column_release(&ttft);
    column_release(&tpot);
    column_release(&context);
    PyMem_Free(releases);
    PyMem_Free(initial);
    Py_XDECREF(whole_queued);
    Py_XDECREF(times);
    Py_XDECREF(through);
    return result;
}

PyDoc_STRVAR(overdue_doc,
"overdue(next_index, arrival, ttft, now, limit)\n"
"--\n\n"
"The rows still without a first token `limit` seconds after their TTFT deadline\n"
"(policies._overdue), as a list.");

static PyObject *overdue(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (argument_count(nargs, 5, "overdue") < 0) {
        return NULL;
    }
    int failed = 0;
    double now = number(args[3], &failed);
    double limit = number(args[4], &failed);
    if (failed) {
        return NULL;
    }
    Column next_index = {0}, arrival = {0}, ttft = {0};
    PyObject *rows_over = NULL;
    Py_ssize_t rows = column_length(args[0]);
    if (column_take(&next_index, args[0], 'q', rows, "next_index") < 0
        || column_take(&arrival, args[1], 'd', rows, "arrival") < 0
        || column_take(&ttft, args[2], 'd', rows, "ttft") < 0) {
        goto done;
    }
    rows_over = PyList_New(0);
    if (rows_over == NULL) {
        goto done;
    }
    for (Py_ssize_t row = 0; row < rows; row++) {
        if (as_int(&next_index, row) == 0
            && now - as_double(&arrival, row) - as_double(&ttft, row) > limit) {
            PyObject *item = PyLong_FromSsize_t(row);
            if (item == NULL || PyList_Append(rows_over, item) < 0) {
                Py_XDECREF(item);
                Py_CLEAR(rows_over);
                goto done;
            }
            Py_DECREF(item);
        }
    }

done:
    column_release(&next_index);
    column_release(&arrival);
    column_release(&ttft);
    return rows_over;
}

enum {
    FIT_PENDING, FIT_CONTEXT, FIT_SLACK, FIT_ROWS, FIT_KNEE, FIT_B, FIT_C, FIT_E, FIT_BASE,
    FIT_STEPS_PER_SECOND, FIT_BUDGET, FIT_ARGS
};

PyDoc_STRVAR(prefills_late_doc,
"prefills_late(pending, context, slack, rows, knee_tokens, b, c, e, base_tokens,\n"
"              steps_per_second, time_budget_s)\n"
"--\n\n"
"Whether a prefill of `rows`, served in that order at the pace of the smooth step,\n"
"ends past its slack (row_groups.RowGroups.smooth_step's last check): each prefill's\n"
"cost by the step model (the knee model, or the linear one where knee_tokens is None),\n"
"summed left to right.");

static PyObject *prefills_late(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (argument_count(nargs, FIT_ARGS, "prefills_late") < 0) {
        return NULL;
    }
    int failed = 0;
    int knee = args[FIT_KNEE] != Py_None;
    double knee_tokens = knee ? number(args[FIT_KNEE], &failed) : 0.0;
    double b = number(args[FIT_B], &failed);
    double c = number(args[FIT_C], &failed);
    double e = knee ? number(args[FIT_E], &failed) : 0.0;
    int64_t base = PyLong_AsLongLong(args[FIT_BASE]);
    double steps_per_second = number(args[FIT_STEPS_PER_SECOND], &failed);
    double budget = number(args[FIT_BUDGET], &failed);
    if (failed || PyErr_Occurred()) {
        return NULL;
    }
    Column pending = {0}, context = {0}, slack = {0}, rows = {0};
    PyObject *result = NULL;
    Py_ssize_t count = column_length(args[FIT_PENDING]);
    Py_ssize_t selected = column_length(args[FIT_ROWS]);
    if (column_take(&pending, args[FIT_PENDING], 'q', count, "pending") < 0
        || column_take(&context, args[FIT_CONTEXT], 'q', count, "context") < 0
        || column_take(&slack, args[FIT_SLACK], 'd', count, "slack") < 0
        || column_take(&rows, args[FIT_ROWS], 'q', selected, "rows") < 0) {
        goto done;
    }
    double before = (double)base > knee_tokens ? (double)base : knee_tokens;
    double queued = 0.0;
    int late = 0;
    for (Py_ssize_t i = 0; i < selected && !late; i++) {
        int64_t row = as_int(&rows, i);
        if (row < 0 || row >= count) {
            PyErr_SetString(PyExc_IndexError, "a row out of the table");
            goto done;
        }
        int64_t chunk = as_int(&pending, row);
        int64_t prefix = as_int(&context, row);
        double cost;
        if (knee) { /* KneeStepModel.prefill_cost_s, elementwise as row_groups.prefill_costs_s */
            double after = (double)(base + chunk);
            if (after < knee_tokens || isnan(knee_tokens)) {
                after = knee_tokens;
            }
            cost = b * (after - before) + c * (double)prefix
                   + e * (double)chunk * ((double)prefix + (double)(chunk + 1) / 2.0);
        } else {
            cost = b * (double)chunk + c * (double)prefix;
        }
        queued = i ? queued + cost : cost;
        late = queued * steps_per_second + budget > as_double(&slack, row);
    }
    result = PyBool_FromLong(late);

done:
    column_release(&pending);
    column_release(&context);
    column_release(&slack);
    column_release(&rows);
    return result;
}

enum {
    COLS_DECODE_ROWS, COLS_DECODE_NEXT, COLS_DECODE_FIRST, COLS_PREFILL_ROWS,
    COLS_PREFILL_NEXT, COLS_PREFILL_PENDING, COLS_PREFILL_CONTEXT, COLS_PREFILL_FIRST,
    COLS_ARRIVAL, COLS_TTFT, COLS_TPOT, COLS_PROMPT, COLS_SEQ, COLS_INTS_OUT, COLS_FLOATS_OUT,
    COLS_ARGS
};

PyDoc_STRVAR(decision_columns_doc,
"decision_columns(decode_rows, decode_next, decode_first, prefill_rows, prefill_next,\n"
"                 prefill_pending, prefill_context, prefill_first,\n"
"                 arrival, ttft, tpot, prompt, seq, ints_out, floats_out)\n"
"--\n\n"
"The SGLang adapter's decision columns (DecisionColumns.table): the decodes' and the\n"
"prefills' collected lists, and the request store's columns, into ints_out (a C-ordered\n"
"int64 array of 6 x rows: store row, next index, pending, context, prompt, arrival\n"
"number) and floats_out (float64, 4 x rows: arrival, ttft, tpot, first). A decode's\n"
"context is its prompt plus its next index; a prefill's, the collected one.");

/* The items of a list of ints (kind 'q') or floats ('d') into out[0..count). */
static int list_into(PyObject *list, Py_ssize_t count, char kind, char *out, const char *name) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != count) {
        PyErr_Format(PyExc_TypeError, "%s: expected a list of %zd values", name, count);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        if (kind == 'd') {
            double value = PyFloat_AsDouble(item);
            if (value == -1.0 && PyErr_Occurred()) {
                return -1;
            }
            ((double *)out)[i] = value;
        } else {
            int64_t value = PyLong_AsLongLong(item);
            if (value == -1 && PyErr_Occurred()) {
                return -1;
            }
            ((int64_t *)out)[i] = value;
        }
    }
    return 0;
}

/* A C-ordered buffer of `ndim` dimensions of `shape`, float64 (kind 'd') or int64 ('q'),
   writable where asked; -1 (released) with a TypeError naming `name` otherwise. */
static int contiguous(Py_buffer *view, PyObject *array, int writable, char kind, int ndim,
                      const Py_ssize_t *shape, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(array, view, flags) < 0) {
        return -1;
    }
    const char *format = view->format ? view->format : "B";
    char last = format[strlen(format) - 1];
    int matches = view->itemsize == 8 && view->ndim == ndim
                  && (kind == 'd' ? last == 'd' : (last == 'l' || last == 'q'));
    for (int axis = 0; matches && axis < ndim; axis++) {
        matches = view->shape[axis] == shape[axis];
    }
    if (!matches) {
        PyErr_Format(PyExc_TypeError, "%s: expected a%s C-ordered %d-d %s array of %zd rows",
                     name, writable ? " writable" : "", ndim,
                     kind == 'd' ? "float64" : "int64", shape[0]);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *decision_columns(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (argument_count(nargs, COLS_ARGS, "decision_columns") < 0) {
        return NULL;
    }
    if (!PyList_Check(args[COLS_DECODE_ROWS]) || !PyList_Check(args[COLS_PREFILL_ROWS])) {
        PyErr_SetString(PyExc_TypeError, "decision_columns: the rows must be lists");
        return NULL;
    }
    Py_ssize_t decodes = PyList_GET_SIZE(args[COLS_DECODE_ROWS]);
    Py_ssize_t prefills = PyList_GET_SIZE(args[COLS_PREFILL_ROWS]);
    Py_ssize_t rows = decodes + prefills;
    Py_buffer ints_view, floats_view;
    Column arrival = {0}, ttft = {0}, tpot = {0}, prompt = {0}, seq = {0};
    PyObject *result = NULL;
    Py_ssize_t ints_shape[2] = {6, rows}, floats_shape[2] = {4, rows};
    if (contiguous(&ints_view, args[COLS_INTS_OUT], 1, 'q', 2, ints_shape, "ints_out") < 0) {
        return NULL;
    }
    if (contiguous(&floats_view, args[COLS_FLOATS_OUT], 1, 'd', 2, floats_shape,
                   "floats_out") < 0) {
        PyBuffer_Release(&ints_view);
        return NULL;
    }
    int64_t *ints = (int64_t *)ints_view.buf;
    double *floats = (double *)floats_view.buf;
    int64_t *store_row = ints, *next = ints + rows, *pending = ints + 2 * rows,
            *context = ints + 3 * rows, *prompts = ints + 4 * rows, *seqs = ints + 5 * rows;
    double *arrivals = floats, *ttfts = floats + rows, *tpots = floats + 2 * rows,
           *firsts = floats + 3 * rows;
    if (list_into(args[COLS_DECODE_ROWS], decodes, 'q', (char *)store_row, "decode_rows") < 0
        || list_into(args[COLS_DECODE_NEXT], decodes, 'q', (char *)next, "decode_next") < 0
        || list_into(args[COLS_DECODE_FIRST], decodes, 'd', (char *)firsts, "decode_first") < 0
        || list_into(args[COLS_PREFILL_ROWS], prefills, 'q', (char *)(store_row + decodes),
                     "prefill_rows") < 0
        || list_into(args[COLS_PREFILL_NEXT], prefills, 'q', (char *)(next + decodes),
                     "prefill_next") < 0
        || list_into(args[COLS_PREFILL_PENDING], prefills, 'q', (char *)(pending + decodes),
                     "prefill_pending") < 0
        || list_into(args[COLS_PREFILL_CONTEXT], prefills, 'q', (char *)(context + decodes),
                     "prefill_context") < 0
        || list_into(args[COLS_PREFILL_FIRST], prefills, 'd', (char *)(firsts + decodes),
                     "prefill_first") < 0) {
        goto done;
    }
    Py_ssize_t store_size = column_length(args[COLS_PROMPT]);
    if (column_take(&arrival, args[COLS_ARRIVAL], 'd', store_size, "arrival") < 0
        || column_take(&ttft, args[COLS_TTFT], 'd', store_size, "ttft") < 0
        || column_take(&tpot, args[COLS_TPOT], 'd', store_size, "tpot") < 0
        || column_take(&prompt, args[COLS_PROMPT], 'q', store_size, "prompt") < 0
        || column_take(&seq, args[COLS_SEQ], 'q', store_size, "seq") < 0) {
        goto done;
    }
    for (Py_ssize_t row = 0; row < rows; row++) {
        int64_t at = store_row[row];
        if (at < 0 || at >= store_size) {
            PyErr_SetString(PyExc_IndexError, "a store row out of the store");
            goto done;
        }
        arrivals[row] = as_double(&arrival, at);
        ttfts[row] = as_double(&ttft, at);
        tpots[row] = as_double(&tpot, at);
        prompts[row] = as_int(&prompt, at);
        seqs[row] = as_int(&seq, at);
        if (row < decodes) {
            pending[row] = 0;
            context[row] = prompts[row] + next[row];
        }
    }
    result = Py_NewRef(Py_None);
done:
    column_release(&arrival);
    column_release(&ttft);
    column_release(&tpot);
    column_release(&prompt);
    column_release(&seq);
    PyBuffer_Release(&ints_view);
    PyBuffer_Release(&floats_view);
    return result;
}

enum {
    KNEE_FEATURES, KNEE_NEW_TOKENS, KNEE_DECODES, KNEE_DECODE_CONTEXT, KNEE_MEASURED,
    KNEE_FORGETTING, KNEE_KNEES, KNEE_SATURATIONS, KNEE_SCALE, KNEE_GRAM, KNEE_MOMENT,
    KNEE_ARGS
};

PyDoc_STRVAR(knee_update_doc,
"knee_update(features, new_tokens, decode_requests, decode_context, measured_s,\n"
"            forgetting, knees, saturations, scale, gram, moment)\n"
"--\n\n"
"One step's update of every candidate's normal equations in the online knee model\n"
"(sglang_ext.policy.online_knee.OnlineKneeModel.observe): each candidate's regressors\n"
"(features, with its knee's new-token term and its saturation's decode term), scaled\n"
"by scale / measured_s; gram and moment forgotten by `forgetting` and the step added,\n"
"in place.");

static PyObject *knee_update(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (argument_count(nargs, KNEE_ARGS, "knee_update") < 0) {
        return NULL;
    }
    enum { MAX_FEATURES = 8 };
    double features[MAX_FEATURES];
    PyObject *given = args[KNEE_FEATURES];
    if (!PyTuple_Check(given) || PyTuple_GET_SIZE(given) < 4
        || PyTuple_GET_SIZE(given) > MAX_FEATURES) {
        PyErr_SetString(PyExc_TypeError, "features must be a tuple of 4 to 8 floats");
        return NULL;
    }
    Py_ssize_t width = PyTuple_GET_SIZE(given);
    for (Py_ssize_t j = 0; j < width; j++) {
        features[j] = PyFloat_AsDouble(PyTuple_GET_ITEM(given, j));
    }
    double new_tokens = PyFloat_AsDouble(args[KNEE_NEW_TOKENS]);
    long long decodes = PyLong_AsLongLong(args[KNEE_DECODES]);
    double decode_context = PyFloat_AsDouble(args[KNEE_DECODE_CONTEXT]);
    double measured = PyFloat_AsDouble(args[KNEE_MEASURED]);
    double forgetting = PyFloat_AsDouble(args[KNEE_FORGETTING]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer knees_view, saturations_view, scale_view, gram_view, moment_view;
    Py_ssize_t candidates = column_length(args[KNEE_KNEES]);
    Py_ssize_t one[1] = {candidates}, two[2] = {candidates, width},
               three[3] = {candidates, width, width};
    if (contiguous(&knees_view, args[KNEE_KNEES], 0, 'd', 1, one, "knees") < 0) {
        return NULL;
    }
    if (contiguous(&saturations_view, args[KNEE_SATURATIONS], 0, 'd', 1, one, "saturations") < 0) {
        PyBuffer_Release(&knees_view);
        return NULL;
    }
    if (contiguous(&scale_view, args[KNEE_SCALE], 0, 'd', 2, two, "scale") < 0) {
        PyBuffer_Release(&knees_view);
        PyBuffer_Release(&saturations_view);
        return NULL;
    }
    if (contiguous(&gram_view, args[KNEE_GRAM], 1, 'd', 3, three, "gram") < 0) {
        PyBuffer_Release(&knees_view);
        PyBuffer_Release(&saturations_view);
        PyBuffer_Release(&scale_view);
        return NULL;
    }
    if (contiguous(&moment_view, args[KNEE_MOMENT], 1, 'd', 2, two, "moment") < 0) {
        PyBuffer_Release(&knees_view);
        PyBuffer_Release(&saturations_view);
        PyBuffer_Release(&scale_view);
        PyBuffer_Release(&gram_view);
        return NULL;
    }
    const double *knees = knees_view.buf, *saturations = saturations_view.buf,
                 *scale = scale_view.buf;
    double *gram = gram_view.buf, *moment = moment_view.buf;
    double row[MAX_FEATURES];
    double decodes_f = (double)decodes;
    for (Py_ssize_t k = 0; k < candidates; k++) {
        /* the regressors as OnlineKneeModel.observe builds them in numpy, op for op */
        memcpy(row, features, sizeof(double) * (size_t)width);
        row[1] = new_tokens >= knees[k] ? new_tokens : knees[k];
        if (decodes) {
            double ratio = saturations[k] > decodes_f ? saturations[k] / decodes_f : 1.0;
            row[3] = decode_context * ratio;
        }
        for (Py_ssize_t j = 0; j < width; j++) {
            row[j] = row[j] * (scale[k * width + j] / measured);
        }
        double *g = gram + k * width * width;
        for (Py_ssize_t i = 0; i < width * width; i++) {
            g[i] = g[i] * forgetting;
        }
        for (Py_ssize_t i = 0; i < width; i++) {
            for (Py_ssize_t j = 0; j < width; j++) {
                g[i * width + j] = g[i * width + j] + row[i] * row[j];
            }
        }
        double *m = moment + k * width;
        for (Py_ssize_t j = 0; j < width; j++) {
            m[j] = m[j] * forgetting;
            m[j] = m[j] + row[j];
        }
    }
    PyBuffer_Release(&knees_view);
    PyBuffer_Release(&saturations_view);
    PyBuffer_Release(&scale_view);
    PyBuffer_Release(&gram_view);
    PyBuffer_Release(&moment_view);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(knee_system_doc,
"knee_system(index, anchor, gram, moment, prior, matrix_out, rhs_out)\n"
"--\n\n"
"The anchored normal equations of the online knee model's candidate `index`, as\n"
"OnlineKneeModel._solve_current writes them in numpy: matrix_out = gram[index] +\n"
"anchor * identity, rhs_out = moment[index] + anchor * prior[index].");

static PyObject *knee_system(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (argument_count(nargs, 7, "knee_system") < 0) {
        return NULL;
    }
    Py_ssize_t index = PyLong_AsSsize_t(args[0]);
    double anchor = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer moment_view, gram_view, prior_view, matrix_view, rhs_view;
    if (PyObject_GetBuffer(args[3], &moment_view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return NULL;
    }
    Py_ssize_t candidates = moment_view.ndim == 2 ? moment_view.shape[0] : 0;
    Py_ssize_t width = moment_view.ndim == 2 ? moment_view.shape[1] : 0;
    PyBuffer_Release(&moment_view);
    if (index < 0 || index >= candidates) {
        PyErr_SetString(PyExc_IndexError, "knee_system: no such candidate");
        return NULL;
    }
    Py_ssize_t two[2] = {candidates, width}, three[3] = {candidates, width, width},
               square[2] = {width, width}, line[1] = {width};
    if (contiguous(&gram_view, args[2], 0, 'd', 3, three, "gram") < 0) {
        return NULL;
    }
    if (contiguous(&moment_view, args[3], 0, 'd', 2, two, "moment") < 0) {
        PyBuffer_Release(&gram_view);
        return NULL;
    }
    if (contiguous(&prior_view, args[4], 0, 'd', 2, two, "prior") < 0) {
        PyBuffer_Release(&gram_view);
        PyBuffer_Release(&moment_view);
        return NULL;
    }
    if (contiguous(&matrix_view, args[5], 1, 'd', 2, square, "matrix_out") < 0) {
        PyBuffer_Release(&gram_view);
        PyBuffer_Release(&moment_view);
        PyBuffer_Release(&prior_view);
        return NULL;
    }
    if (contiguous(&rhs_view, args[6], 1, 'd', 1, line, "rhs_out") < 0) {
        PyBuffer_Release(&gram_view);
        PyBuffer_Release(&moment_view);
        PyBuffer_Release(&prior_view);
        PyBuffer_Release(&matrix_view);
        return NULL;
    }
    const double *gram = (const double *)gram_view.buf + index * width * width;
    const double *moment = (const double *)moment_view.buf + index * width;
    const double *prior = (const double *)prior_view.buf + index * width;
    double *matrix = matrix_view.buf, *rhs = rhs_view.buf;
    for (Py_ssize_t i = 0; i < width; i++) {
        for (Py_ssize_t j = 0; j < width; j++) {
            matrix[i * width + j] = gram[i * width + j] + anchor * (i == j ? 1.0 : 0.0);
        }
        rhs[i] = moment[i] + anchor * prior[i];
    }
    PyBuffer_Release(&gram_view);
    PyBuffer_Release(&moment_view);
    PyBuffer_Release(&prior_view);
    PyBuffer_Release(&matrix_view);
    PyBuffer_Release(&rhs_view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"queue_forecast", (PyCFunction)(void (*)(void))queue_forecast, METH_FASTCALL,
     queue_forecast_doc},
    {"triage", (PyCFunction)(void (*)(void))triage, METH_FASTCALL, triage_doc},
    {"kv_outlook", (PyCFunction)(void (*)(void))kv_outlook, METH_FASTCALL, kv_outlook_doc},
    {"overdue", (PyCFunction)(void (*)(void))overdue, METH_FASTCALL, overdue_doc},
    {"prefills_late", (PyCFunction)(void (*)(void))prefills_late, METH_FASTCALL,
     prefills_late_doc},
    {"decision_columns", (PyCFunction)(void (*)(void))decision_columns, METH_FASTCALL,
     decision_columns_doc},
    {"knee_update", (PyCFunction)(void (*)(void))knee_update, METH_FASTCALL, knee_update_doc},
    {"knee_system", (PyCFunction)(void (*)(void))knee_system, METH_FASTCALL, knee_system_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_compiled",
    "FairBatching's decision hot path, compiled (sglang_ext.policy.compiled).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__compiled(void) {
    REQ_ID = PyUnicode_InternFromString("req_id");
    GET = PyUnicode_InternFromString("get");
    if (REQ_ID == NULL || GET == NULL) {
        return NULL;
    }
    return PyModule_Create(&module);
}
