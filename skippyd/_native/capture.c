/* The graph-output capture of a non-final stage: llama.cpp's eval callback, in C.
 *
 * llama.cpp calls a context's cb_eval for every node of the graph (several hundred per
 * decode), first to ask whether the node is wanted, then, for a wanted one, once it is
 * computed. This callback wants one node, the stage's last layer output, and copies its
 * rows into a buffer the Python runtime owns; it stops the graph there, since the rest
 * (norm, output head) belongs to a later stage. A Python callback would pay a ctypes
 * transition and the GIL on every node.
 *
 * struct skippyd_capture is shared with Python (ctypes.Structure _CaptureState in
 * skippyd/engine/runtime/native.py); skippyd_capture_state_size() lets the loader check
 * that both sides agree on its layout.
 */

#include <stdbool.h>
#include <stddef.h>
#include <string.h>

typedef const char *(*get_name_fn)(const void *tensor);
typedef size_t (*nbytes_fn)(const void *tensor);
typedef void (*tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);

struct skippyd_capture {
    get_name_fn get_name;
    nbytes_fn nbytes;
    tensor_get_fn tensor_get;
    char *buffer;
    size_t capacity;
    size_t used;
    int overflow;
    char target[64];
};

size_t skippyd_capture_state_size(void) {
    return sizeof(struct skippyd_capture);
}

bool skippyd_capture_eval(void *tensor, bool ask, void *user_data) {
    struct skippyd_capture *c = (struct skippyd_capture *)user_data;
    const char *name = c->get_name(tensor);
    if (name == NULL || strcmp(name, c->target) != 0) {
        return !ask;  /* not asked for; a computed node lets the graph go on */
    }
    if (ask) {
        return true;
    }
    size_t size = c->nbytes(tensor);
    if (c->used + size > c->capacity) {
        c->overflow = 1;
    } else {
        c->tensor_get(tensor, c->buffer + c->used, 0, size);
        c->used += size;
    }
    return false;  /* stop: the rest of the graph is not needed */
}
