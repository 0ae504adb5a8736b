/* Launching compiled Triton kernels (cubins) from C, for both sides of the library.

   1. An XLA FFI handler, `jl_triton_launch` (built with -DJL_XLA_FFI against jaxlib's
      xla/ffi/api/c_api.h; jax_lora/ops/ffi_launcher.py). jax_triton's `triton_kernel_call` is a
      legacy custom call, which XLA launches from the host one by one, outside its command buffers
      (CUDA graphs); at decode sizes that host time is the whole cost. This handler declares itself
      command-buffer compatible (it always launches the same kernels for the same attributes), so
      XLA can record it into its graphs.
   2. Prepared launches for torch (`jl_prepared_*`; torch_lora/ops/c_launch.py for PreparedLinear): a
      kernel's parameter block is built once per layer, and a call only patches the few parameters
      that change (x, y, workspace, ranks pointers and the scale) and launches, without Triton's
      Python launcher and its per-launch host time.

   Only CUDA's driver API is used (cuda.h as bundled with Triton), loaded with dlopen: the library
   builds with a plain C compiler at first use (jax_lora/kernels/cuda_launch.py) and links nothing.

   FFI kernels are registered from Python under a 63-bit id (a hash of the cubin and the kernel
   name) and loaded into each device's primary context at registration, never inside a launch
   (which may run under stream capture). A call carries, as attributes:

     kernels  int64[n]      ids of the n kernels launched in order on the stream
     launch   int64[8 * n]  per kernel: grid x, y, z, threads per block, dynamic shared memory,
                            flags (1 programmatic dependent launch, 2 cooperative), number of
                            parameters, index of a result to zero before the launch (-1: none)
     params   int64[2 * sum of parameters]  per parameter (kind, value):
                            0 operand pointer (value: operand index), 1 result pointer (index),
                            2 int32, 3 float32 (value: its bits), 4 int64, 5 null pointer
                            (Triton's global / profile scratch when the kernel needs none),
                            7 the device's barrier counters (value: first int32),
                            8 operand pointer at a byte offset (value: index | offset << 16;
                            a view into the operand, e.g. one slice of stacked weights)
*/
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"
#ifdef JL_XLA_FFI
#include "xla/ffi/api/c_api.h"
#endif

#define JL_MAX_KERNELS 4096 /* table slots (open addressing) */
#define JL_MAX_DEVICES 16
#define JL_MAX_PARAMS 256   /* parameters of one kernel */
#define JL_MAX_LAUNCHES 4

typedef CUresult (*LaunchKernelEx_t)(const CUlaunchConfig*, CUfunction, void**, void**);
typedef CUresult (*MemsetD8Async_t)(CUdeviceptr, unsigned char, size_t, CUstream);
typedef CUresult (*CtxGetDevice_t)(CUdevice*);
typedef CUresult (*DeviceGet_t)(CUdevice*, int);
typedef CUresult (*PrimaryCtxRetain_t)(CUcontext*, CUdevice);
typedef CUresult (*CtxPushCurrent_t)(CUcontext);
typedef CUresult (*CtxPopCurrent_t)(CUcontext*);
typedef CUresult (*ModuleLoadData_t)(CUmodule*, const void*);
typedef CUresult (*ModuleGetFunction_t)(CUfunction*, CUmodule, const char*);
typedef CUresult (*FuncSetAttribute_t)(CUfunction, CUfunction_attribute, int);
typedef CUresult (*GetErrorString_t)(CUresult, const char**);
typedef CUresult (*Init_t)(unsigned int);
typedef CUresult (*MemAlloc_t)(CUdeviceptr*, size_t);
typedef CUresult (*MemsetD8_t)(CUdeviceptr, unsigned char, size_t);

static struct {
  int ready;
  LaunchKernelEx_t launch;
  MemsetD8Async_t memset8;
  CtxGetDevice_t ctx_get_device;
  DeviceGet_t device_get;
  PrimaryCtxRetain_t primary_retain;
  CtxPushCurrent_t push;
  CtxPopCurrent_t pop;
  ModuleLoadData_t module_load;
  ModuleGetFunction_t get_function;
  FuncSetAttribute_t set_attribute;
  GetErrorString_t error_string;
  MemAlloc_t mem_alloc;
  MemsetD8_t memset8_sync;
} cu;

typedef struct {
  int64_t id; /* 0: free slot */
  CUfunction fn[JL_MAX_DEVICES];
} Kernel;

static Kernel table[JL_MAX_KERNELS];
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;

static int load_driver(char* err, int err_len) {
  if (cu.ready) return 0;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    snprintf(err, err_len, "jax_lora ffi launcher: cannot dlopen libcuda.so.1: %s", dlerror());
    return -1;
  }
#define JL_SYM(field, name)                                                      \
  cu.field = (__typeof__(cu.field))dlsym(lib, name);                             \
  if (!cu.field) {                                                               \
    snprintf(err, err_len, "jax_lora ffi launcher: libcuda has no %s", name);   \
    return -1;                                                                   \
  }
  JL_SYM(launch, "cuLaunchKernelEx");
  JL_SYM(memset8, "cuMemsetD8Async");
  JL_SYM(ctx_get_device, "cuCtxGetDevice");
  JL_SYM(device_get, "cuDeviceGet");
  JL_SYM(primary_retain, "cuDevicePrimaryCtxRetain");
  JL_SYM(push, "cuCtxPushCurrent_v2");
  JL_SYM(pop, "cuCtxPopCurrent_v2");
  JL_SYM(module_load, "cuModuleLoadData");
  JL_SYM(get_function, "cuModuleGetFunction");
  JL_SYM(set_attribute, "cuFuncSetAttribute");
  JL_SYM(error_string, "cuGetErrorString");
  JL_SYM(mem_alloc, "cuMemAlloc_v2");
  JL_SYM(memset8_sync, "cuMemsetD8_v2");
#undef JL_SYM
  Init_t init = (Init_t)dlsym(lib, "cuInit");
  if (!init || init(0) != CUDA_SUCCESS) {
    snprintf(err, err_len, "jax_lora ffi launcher: cuInit failed");
    return -1;
  }
  cu.ready = 1;
  return 0;
}

static const char* cu_error(CUresult r) {
  const char* s = NULL;
  if (cu.error_string) cu.error_string(r, &s);
  return s ? s : "unknown CUDA error";
}

static Kernel* find_slot(int64_t id, int insert) {
  uint64_t h = (uint64_t)id * 0x9E3779B97F4A7C15ull;
  for (int probe = 0; probe < JL_MAX_KERNELS; ++probe) {
    Kernel* k = &table[(h + (uint64_t)probe) % JL_MAX_KERNELS];
    int64_t key = __atomic_load_n(&k->id, __ATOMIC_ACQUIRE);
    if (key == id) return k;
    if (key == 0) {
      if (!insert) return NULL;
      __atomic_store_n(&k->id, id, __ATOMIC_RELEASE);
      return k;
    }
  }
  return NULL;
}

/* Loads `cubin` (kernel `name`) into device `device`'s primary context under `id`.
   Returns 0, or -1 with a message in err. Called from Python (ctypes), never from a launch. */
int jl_load_kernel(int64_t id, const void* cubin, const char* name, int shared_bytes, int device, char* err,
                   int err_len) {
  if (id == 0 || device < 0 || device >= JL_MAX_DEVICES) {
    snprintf(err, err_len, "jax_lora ffi launcher: bad kernel id or device %d", device);
    return -1;
  }
  if (load_driver(err, err_len)) return -1;
  pthread_mutex_lock(&table_lock);
  int rc = -1;
  Kernel* k = find_slot(id, 1);
  if (!k) {
    snprintf(err, err_len, "jax_lora ffi launcher: more than %d kernels", JL_MAX_KERNELS);
    goto done;
  }
  if (__atomic_load_n(&k->fn[device], __ATOMIC_ACQUIRE)) {
    rc = 0;
    goto done;
  }
  CUdevice dev;
  CUcontext ctx, popped;
  CUmodule mod;
  CUfunction fn;
  CUresult r = cu.device_get(&dev, device);
  if (r == CUDA_SUCCESS) r = cu.primary_retain(&ctx, dev);
  if (r != CUDA_SUCCESS) {
    snprintf(err, err_len, "jax_lora ffi launcher: device %d: %s", device, cu_error(r));
    goto done;
  }
  if ((r = cu.push(ctx)) != CUDA_SUCCESS) {
    snprintf(err, err_len, "jax_lora ffi launcher: cuCtxPushCurrent: %s", cu_error(r));
    goto done;
  }
  r = cu.module_load(&mod, cubin);
  if (r == CUDA_SUCCESS) r = cu.get_function(&fn, mod, name);
  if (r == CUDA_SUCCESS && shared_bytes > 49152)
    r = cu.set_attribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes);
  cu.pop(&popped);
  if (r != CUDA_SUCCESS) {
    snprintf(err, err_len, "jax_lora ffi launcher: loading %s: %s", name, cu_error(r));
    goto done;
  }
  __atomic_store_n(&k->fn[device], fn, __ATOMIC_RELEASE);
  rc = 0;
done:
  pthread_mutex_unlock(&table_lock);
  return rc;
}

/* Barrier counters (parameter kind 7 of the FFI handler): one zeroed int32 buffer per device,
   allocated outside any launch (jl_ensure_counters, called when a program is traced) and never
   freed (recorded graphs keep its address). Kernels using them leave every counter as a multiple
   of their span (lora_fused_kernel), so they need zeroing only once. One buffer per device: XLA
   launches a device's work on one compute stream; two such kernels must not run concurrently. */
static CUdeviceptr counters[JL_MAX_DEVICES];
static int64_t counter_ints[JL_MAX_DEVICES];

/* Makes device `device`'s counter buffer hold at least `ints` int32 (a new, zeroed buffer when
   it is smaller). 0, or -1 with a message in err. */
int jl_ensure_counters(int device, int64_t ints, char* err, int err_len) {
  if (device < 0 || device >= JL_MAX_DEVICES || ints < 0) {
    snprintf(err, err_len, "jax_lora ffi launcher: bad device %d or counter count", device);
    return -1;
  }
  if (load_driver(err, err_len)) return -1;
  pthread_mutex_lock(&table_lock);
  int rc = -1;
  if (__atomic_load_n(&counter_ints[device], __ATOMIC_ACQUIRE) >= ints) {
    rc = 0;
    goto done;
  }
  int64_t n = ints < 16384 ? 16384 : ints;
  CUdevice dev;
  CUcontext ctx, popped;
  CUdeviceptr p = 0;
  CUresult r = cu.device_get(&dev, device);
  if (r == CUDA_SUCCESS) r = cu.primary_retain(&ctx, dev);
  if (r == CUDA_SUCCESS && (r = cu.push(ctx)) == CUDA_SUCCESS) {
    r = cu.mem_alloc(&p, (size_t)n * 4);
    if (r == CUDA_SUCCESS) r = cu.memset8_sync(p, 0, (size_t)n * 4);
    cu.pop(&popped);
  }
  if (r != CUDA_SUCCESS) {
    snprintf(err, err_len, "jax_lora ffi launcher: barrier counters on device %d: %s", device, cu_error(r));
    goto done;
  }
  counters[device] = p;
  __atomic_store_n(&counter_ints[device], n, __ATOMIC_RELEASE);
  rc = 0;
done:
  pthread_mutex_unlock(&table_lock);
  return rc;
}

/* Launch attributes from flags: 1 programmatic dependent launch, 2 cooperative (the driver refuses
   a grid whose blocks cannot all be resident at once). Returns how many were written (<= 2). */
static unsigned launch_attrs(CUlaunchAttribute* attr, int flags) {
  unsigned n = 0;
  if (flags & 1) {
    attr[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr[n].value.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (flags & 2) {
    attr[n].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attr[n].value.cooperative = 1;
    ++n;
  }
  return n;
}

/* ------------------------------------------------------------------ prepared launches (torch) */

typedef struct {
  CUfunction fn;
  unsigned grid[3], threads, shared;
  int flags, nparams, nslots;
  int slot_param[8], slot_var[8], slot_float[8];
  uint64_t store[JL_MAX_PARAMS];
} JlPrepared;

/* A kernel launch with its parameter block built once. kv: 2 * nparams int64 (kind, value) with
   kinds 2 int32, 3 float32 (its bits), 4 int64, 5 null pointer, 6 pointer (value: the address);
   slots: nslots (parameter index, variable index) pairs, patched at every launch from `vars`.
   Returns NULL with a message in err on bad input. */
void* jl_prepared_new(void* fn, int gx, int gy, int gz, int threads, int shared, int flags, int nparams,
                      const int64_t* kv, int nslots, const int32_t* slots, char* err, int err_len) {
  if (load_driver(err, err_len)) return NULL;
  if (!fn || nparams < 0 || nparams > JL_MAX_PARAMS || nslots < 0 || nslots > 8) {
    snprintf(err, err_len, "jax_lora prepared launch: bad function, parameter or slot count");
    return NULL;
  }
  JlPrepared* p = (JlPrepared*)calloc(1, sizeof(JlPrepared));
  if (!p) {
    snprintf(err, err_len, "jax_lora prepared launch: out of memory");
    return NULL;
  }
  p->fn = (CUfunction)fn;
  p->grid[0] = (unsigned)gx;
  p->grid[1] = (unsigned)gy;
  p->grid[2] = (unsigned)gz;
  p->threads = (unsigned)threads;
  p->shared = (unsigned)shared;
  p->flags = flags;
  p->nparams = nparams;
  p->nslots = nslots;
  for (int i = 0; i < nparams; ++i) {
    int64_t kind = kv[2 * i], v = kv[2 * i + 1];
    if (kind == 2 || kind == 3) {
      int32_t w = (int32_t)v;
      memcpy(&p->store[i], &w, sizeof(w));
    } else if (kind == 4 || kind == 6) {
      memcpy(&p->store[i], &v, sizeof(v));
    } else if (kind != 5) {
      snprintf(err, err_len, "jax_lora prepared launch: bad parameter kind %lld", (long long)kind);
      free(p);
      return NULL;
    }
  }
  for (int k = 0; k < nslots; ++k) {
    int at = slots[2 * k];
    if (at < 0 || at >= nparams) {
      snprintf(err, err_len, "jax_lora prepared launch: bad slot %d", at);
      free(p);
      return NULL;
    }
    p->slot_param[k] = at;
    p->slot_var[k] = slots[2 * k + 1];
    p->slot_float[k] = kv[2 * at] == 3;
  }
  return p;
}

void jl_prepared_free(void* p) { free(p); }

/* Launches the n prepared kernels in order on `stream`, each with its slots set from vars (a
   pointer, or for float32 slots the float's bits in the low 32 bits). 0, or the CUresult. */
int jl_prepared_launch(void* const* launches, int n, void* stream, const uint64_t* vars) {
  uint64_t store[JL_MAX_PARAMS];
  void* ptrs[JL_MAX_PARAMS];
  for (int l = 0; l < n; ++l) {
    const JlPrepared* p = (const JlPrepared*)launches[l];
    memcpy(store, p->store, sizeof(uint64_t) * (size_t)p->nparams);
    for (int k = 0; k < p->nslots; ++k) {
      uint64_t v = vars[p->slot_var[k]];
      if (p->slot_float[k]) {
        uint32_t bits = (uint32_t)v;
        memcpy(&store[p->slot_param[k]], &bits, sizeof(bits));
      } else {
        store[p->slot_param[k]] = v;
      }
    }
    for (int i = 0; i < p->nparams; ++i) ptrs[i] = &store[i];
    CUlaunchAttribute attr[2];
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    memset(attr, 0, sizeof(attr));
    cfg.gridDimX = p->grid[0];
    cfg.gridDimY = p->grid[1];
    cfg.gridDimZ = p->grid[2];
    cfg.blockDimX = p->threads;
    cfg.blockDimY = 1;
    cfg.blockDimZ = 1;
    cfg.sharedMemBytes = p->shared;
    cfg.hStream = (CUstream)stream;
    cfg.attrs = attr;
    cfg.numAttrs = launch_attrs(attr, p->flags);
    if (p->grid[0] * p->grid[1] * p->grid[2] == 0) continue;
    CUresult r = cu.launch(&cfg, p->fn, ptrs, NULL);
    if (r != CUDA_SUCCESS) return (int)r;
  }
  return 0;
}

/* The CUDA error string of a CUresult returned by jl_prepared_launch. */
const char* jl_error_string(int r) { return cu_error((CUresult)r); }

/* Lets `fn` be launched with up to `bytes` of dynamic shared memory (above 48 KiB a function must
   opt in). Returns 0 or the CUresult; -1 without a driver. Called from Python, never from a launch. */
int jl_allow_shared(void* fn, int bytes) {
  char err[256];
  if (!fn || load_driver(err, sizeof(err))) return -1;
  return (int)cu.set_attribute((CUfunction)fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes);
}

#ifdef JL_XLA_FFI
static XLA_FFI_Error* ffi_error(const XLA_FFI_Api* api, XLA_FFI_Error_Code code, const char* msg) {
  XLA_FFI_Error_Create_Args a;
  memset(&a, 0, sizeof(a));
  a.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  a.message = msg;
  a.errc = code;
  return api->XLA_FFI_Error_Create(&a);
}

static const XLA_FFI_Array* int64_attr(const XLA_FFI_CallFrame* cf, const char* name) {
  size_t len = strlen(name);
  for (int64_t i = 0; i < cf->attrs.size; ++i) {
    const XLA_FFI_ByteSpan* n = cf->attrs.names[i];
    if (n->len == len && memcmp(n->ptr, name, len) == 0) {
      if (cf->attrs.types[i] != XLA_FFI_AttrType_ARRAY) return NULL;
      const XLA_FFI_Array* a = (const XLA_FFI_Array*)cf->attrs.attrs[i];
      return a->dtype == XLA_FFI_DataType_S64 ? a : NULL;
    }
  }
  return NULL;
}

static size_t dtype_bytes(XLA_FFI_DataType t) {
  switch (t) {
    case XLA_FFI_DataType_PRED: case XLA_FFI_DataType_S8: case XLA_FFI_DataType_U8: return 1;
    case XLA_FFI_DataType_S16: case XLA_FFI_DataType_U16: case XLA_FFI_DataType_F16:
    case XLA_FFI_DataType_BF16: return 2;
    case XLA_FFI_DataType_S32: case XLA_FFI_DataType_U32: case XLA_FFI_DataType_F32: return 4;
    case XLA_FFI_DataType_S64: case XLA_FFI_DataType_U64: case XLA_FFI_DataType_F64: return 8;
    default: return 0;
  }
}

static XLA_FFI_Error* report_metadata(XLA_FFI_CallFrame* cf) {
  XLA_FFI_Metadata_Extension* ext = (XLA_FFI_Metadata_Extension*)cf->extension_start;
  XLA_FFI_Metadata* m = ext->metadata;
  m->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
  m->api_version.extension_start = NULL;
  m->api_version.major_version = XLA_FFI_API_MAJOR;
  m->api_version.minor_version = XLA_FFI_API_MINOR;
  m->traits = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE;
  if (m->struct_size >= offsetof(XLA_FFI_Metadata, state_type_id) + sizeof(m->state_type_id))
    memset(&m->state_type_id, 0, sizeof(m->state_type_id)); /* stateless */
  return NULL;
}

static int64_t handler_calls; /* execute-stage calls, for diagnostics (jl_handler_calls) */

/* How many times XLA has called the handler's execute stage: a call replayed from one of XLA's
   command buffers does not call it, a recorded or eagerly launched one does. */
int64_t jl_handler_calls(void) { return __atomic_load_n(&handler_calls, __ATOMIC_RELAXED); }

/* The handler (execute stage). */
XLA_FFI_Error* jl_triton_launch(XLA_FFI_CallFrame* cf) {
  if (cf->extension_start && cf->extension_start->type == XLA_FFI_Extension_Metadata)
    return report_metadata(cf);
  if (cf->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  __atomic_fetch_add(&handler_calls, 1, __ATOMIC_RELAXED);
  const XLA_FFI_Api* api = cf->api;
  char msg[512];
  const XLA_FFI_Array* kernels = int64_attr(cf, "kernels");
  const XLA_FFI_Array* launch = int64_attr(cf, "launch");
  const XLA_FFI_Array* params = int64_attr(cf, "params");
  if (!kernels || !launch || !params || launch->size != 8 * kernels->size || kernels->size > JL_MAX_LAUNCHES)
    return ffi_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                     "jax_lora ffi launcher: attributes kernels/launch/params missing or inconsistent");
  if (!cu.ready) return ffi_error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION,
                                  "jax_lora ffi launcher: no kernel was registered in this process");

  XLA_FFI_Stream_Get_Args sa;
  memset(&sa, 0, sizeof(sa));
  sa.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
  sa.ctx = cf->ctx;
  XLA_FFI_Error* e = api->XLA_FFI_Stream_Get(&sa);
  if (e) return e;
  CUstream stream = (CUstream)sa.stream;
  CUdevice device;
  CUresult r = cu.ctx_get_device(&device);
  if (r != CUDA_SUCCESS || (int)device < 0 || (int)device >= JL_MAX_DEVICES) {
    snprintf(msg, sizeof(msg), "jax_lora ffi launcher: no current CUDA device (%s)", cu_error(r));
    return ffi_error(api, XLA_FFI_Error_Code_INTERNAL, msg);
  }

  const int64_t* ids = (const int64_t*)kernels->data;
  const int64_t* lc = (const int64_t*)launch->data;
  const int64_t* pv = (const int64_t*)params->data;
  size_t p_at = 0;
  uint64_t store[JL_MAX_PARAMS];
  void* ptrs[JL_MAX_PARAMS];
  for (size_t l = 0; l < kernels->size; ++l, lc += 8) {
    Kernel* k = find_slot(ids[l], 0);
    CUfunction fn = k ? __atomic_load_n(&k->fn[(int)device], __ATOMIC_ACQUIRE) : NULL;
    if (!fn) {
      snprintf(msg, sizeof(msg),
               "jax_lora ffi launcher: kernel %lld is not loaded on device %d in this process (kernels are "
               "loaded when the program is traced)", (long long)ids[l], (int)device);
      return ffi_error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION, msg);
    }
    int64_t n = lc[6];
    if (n < 0 || n > JL_MAX_PARAMS || p_at + 2 * (size_t)n > params->size)
      return ffi_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "jax_lora ffi launcher: bad parameter count");
    for (int64_t i = 0; i < n; ++i, p_at += 2) {
      int64_t kind = pv[p_at], v = pv[p_at + 1];
      store[i] = 0;
      if (kind == 0 || kind == 1) {
        const XLA_FFI_Args* a = &cf->args;
        const XLA_FFI_Rets* rt = &cf->rets;
        int64_t count = kind == 0 ? a->size : rt->size;
        if (v < 0 || v >= count)
          return ffi_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "jax_lora ffi launcher: bad buffer index");
        const XLA_FFI_Buffer* b = (const XLA_FFI_Buffer*)(kind == 0 ? a->args[v] : rt->rets[v]);
        CUdeviceptr p = (CUdeviceptr)(uintptr_t)b->data;
        memcpy(&store[i], &p, sizeof(p));
      } else if (kind == 8) {
        int64_t index = v & 0xFFFF, offset = v >> 16;
        if (index >= (int64_t)cf->args.size)
          return ffi_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "jax_lora ffi launcher: bad buffer index");
        const XLA_FFI_Buffer* b = (const XLA_FFI_Buffer*)cf->args.args[index];
        int64_t bytes = (int64_t)dtype_bytes(b->dtype);
        for (int64_t d = 0; d < b->rank; ++d) bytes *= b->dims[d];
        if (offset < 0 || offset >= bytes)
          return ffi_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                           "jax_lora ffi launcher: view offset outside its operand");
        CUdeviceptr p = (CUdeviceptr)(uintptr_t)b->data + (CUdeviceptr)offset;
        memcpy(&store[i], &p, sizeof(p));
      } else if (kind == 2 || kind == 3) {
        int32_t w = (int32_t)v; /* int32, or the bits of a float32 */
        memcpy(&store[i], &w, sizeof(w));
      } else if (kind == 4) {
        memcpy(&store[i], &v, sizeof(v));
      } else if (kind == 7) {
        if (v < 0 || v >= __atomic_load_n(&counter_ints[(int)device], __ATOMIC_ACQUIRE))
          return ffi_error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION,
                           "jax_lora ffi launcher: barrier counters not allocated on this device (they are "
                           "allocated when the program is traced)");
        CUdeviceptr p = counters[(int)device] + (CUdeviceptr)(4 * v);
        memcpy(&store[i], &p, sizeof(p));
      } else if (kind != 5) {
        return ffi_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "jax_lora ffi launcher: bad parameter kind");
      }
      ptrs[i] = &store[i];
    }
    int64_t zero = lc[7];
    if (zero >= 0) {
      if (zero >= cf->rets.size)
        return ffi_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "jax_lora ffi launcher: bad zeroed result");
      const XLA_FFI_Buffer* b = (const XLA_FFI_Buffer*)cf->rets.rets[zero];
      size_t bytes = dtype_bytes(b->dtype);
      for (int64_t d = 0; d < b->rank; ++d) bytes *= (size_t)b->dims[d];
      if (bytes && (r = cu.memset8((CUdeviceptr)(uintptr_t)b->data, 0, bytes, stream)) != CUDA_SUCCESS) {
        snprintf(msg, sizeof(msg), "jax_lora ffi launcher: cuMemsetD8Async: %s", cu_error(r));
        return ffi_error(api, XLA_FFI_Error_Code_INTERNAL, msg);
      }
    }
    if (lc[0] * lc[1] * lc[2] == 0) continue;
    CUlaunchAttribute attr[2];
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    memset(attr, 0, sizeof(attr));
    cfg.gridDimX = (unsigned)lc[0];
    cfg.gridDimY = (unsigned)lc[1];
    cfg.gridDimZ = (unsigned)lc[2];
    cfg.blockDimX = (unsigned)lc[3];
    cfg.blockDimY = 1;
    cfg.blockDimZ = 1;
    cfg.sharedMemBytes = (unsigned)lc[4];
    cfg.hStream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = launch_attrs(attr, (int)lc[5]);
    if ((r = cu.launch(&cfg, fn, ptrs, NULL)) != CUDA_SUCCESS) {
      snprintf(msg, sizeof(msg), "jax_lora ffi launcher: cuLaunchKernelEx: %s", cu_error(r));
      return ffi_error(api, XLA_FFI_Error_Code_INTERNAL, msg);
    }
  }
  return NULL;
}
#endif /* JL_XLA_FFI */
