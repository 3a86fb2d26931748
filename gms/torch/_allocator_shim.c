/* The malloc/free symbols torch's CUDAPluggableAllocator loads.  They forward
 * to callbacks gms.torch.allocator installs from Python (ctypes), so the
 * routing by tag and the RPCs stay in Python. */
#include <stddef.h>
#include <sys/types.h>

typedef void *(*gms_malloc_fn)(ssize_t size, int device, void *stream);
typedef void (*gms_free_fn)(void *ptr, ssize_t size, int device, void *stream);

static gms_malloc_fn malloc_cb;
static gms_free_fn free_cb;

void gms_set_callbacks(gms_malloc_fn m, gms_free_fn f) {
    malloc_cb = m;
    free_cb = f;
}

void *gms_malloc(ssize_t size, int device, void *stream) {
    return malloc_cb ? malloc_cb(size, device, stream) : NULL;
}

void gms_free(void *ptr, ssize_t size, int device, void *stream) {
    if (free_cb) free_cb(ptr, size, device, stream);
}
