/* A model call that first wakes another thread, in one foreign call.
 *
 * The worker wakes the HTTP event loop right before each llama_decode, so the loop
 * handles the last step's tokens while llama.cpp computes. Written from Python, the
 * eventfd wakes a thread that then finds the GIL held and sleeps again; written here,
 * inside the call ctypes makes with the GIL released, it finds the GIL free.
 *
 * llama_batch is passed by value, so its layout must match llama.h's exactly:
 * skippyd_llama_batch_size() lets the loader compare it with the ctypes declaration
 * llama-cpp-python uses, and refuse the helper on a mismatch.
 */

#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

typedef struct {
    int32_t n_tokens;
    void *token;
    void *embd;
    void *pos;
    void *n_seq_id;
    void *seq_id;
    void *logits;
} llama_batch;

typedef int32_t (*decode_fn)(void *ctx, llama_batch batch);

size_t skippyd_llama_batch_size(void) {
    return sizeof(llama_batch);
}

int32_t skippyd_signal_decode(decode_fn decode, int32_t fd, void *ctx, llama_batch batch) {
    uint64_t one = 1;
    ssize_t written = write(fd, &one, sizeof one);
    (void)written;  /* a full or closed eventfd only loses a wake-up nobody needs */
    return decode(ctx, batch);
}
