/* A minimal NVTX tool, received through the injection interface the way
 * Nsight Systems receives NVTX calls: NVTX_INJECTION64_PATH names this
 * library, whose InitializeInjectionNvtx2 fills in the core callbacks.
 * Every event is appended to the file named by FASTCHAIN_NVTX_LOG as one
 * tab-separated line: kind, thread, time (ns), domain, category, message. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <nvtx3/nvToolsExt.h>

typedef struct { char name[256]; } domain_t;
static FILE *out;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t next_range = 1;

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static const char *dname(nvtxDomainHandle_t d) { return d ? ((domain_t *)d)->name : "(default)"; }

static const char *message(const nvtxEventAttributes_t *a) {
    if (!a) return "";
    if (a->messageType == NVTX_MESSAGE_TYPE_ASCII) return a->message.ascii ? a->message.ascii : "";
    if (a->messageType == NVTX_MESSAGE_TYPE_REGISTERED) return a->message.registered ? (const char *)a->message.registered : "";
    return "";
}

static void record(const char *kind, nvtxDomainHandle_t d, const nvtxEventAttributes_t *a, long long extra) {
    pthread_mutex_lock(&lock);
    if (out) {
        fprintf(out, "%s\t%ld\t%lld\t%s\t%u\t%lld\t%s\n", kind, (long)syscall(SYS_gettid), now_ns(),
                dname(d), a ? a->category : 0, extra, message(a));
        fflush(out);
    }
    pthread_mutex_unlock(&lock);
}

static nvtxDomainHandle_t NVTX_API domain_create(const char *name) {
    domain_t *d = calloc(1, sizeof(domain_t));
    strncpy(d->name, name ? name : "", sizeof(d->name) - 1);
    return (nvtxDomainHandle_t)d;
}
static void NVTX_API domain_destroy(nvtxDomainHandle_t d) { (void)d; }
static nvtxStringHandle_t NVTX_API register_string(nvtxDomainHandle_t d, const char *s) {
    (void)d;
    return (nvtxStringHandle_t)strdup(s ? s : "");
}
static void NVTX_API name_category(nvtxDomainHandle_t d, uint32_t id, const char *name) {
    nvtxEventAttributes_t a = {0};
    a.category = id;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = name;
    record("category", d, &a, 0);
}
static void NVTX_API mark(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a) { record("mark", d, a, 0); }
static int NVTX_API push(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a) { record("push", d, a, 0); return 0; }
static int NVTX_API pop(nvtxDomainHandle_t d) { record("pop", d, NULL, 0); return 0; }
static nvtxRangeId_t NVTX_API start(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a) {
    pthread_mutex_lock(&lock);
    uint64_t id = next_range++;
    pthread_mutex_unlock(&lock);
    record("start", d, a, (long long)id);
    return id;
}
static void NVTX_API end(nvtxDomainHandle_t d, nvtxRangeId_t id) { record("end", d, NULL, (long long)id); }
/* The default domain (nvtxRangePushEx & co.) */
static int NVTX_API core_push(const nvtxEventAttributes_t *a) { return push(NULL, a); }
static int NVTX_API core_pop(void) { return pop(NULL); }
static void NVTX_API core_mark(const nvtxEventAttributes_t *a) { mark(NULL, a); }

int NVTX_API InitializeInjectionNvtx2(NvtxGetExportTableFunc_t getExportTable) {
    const NvtxExportTableCallbacks *cb = (const NvtxExportTableCallbacks *)getExportTable(NVTX_ETID_CALLBACKS);
    NvtxFunctionTable t = 0;
    unsigned int n = 0;
    const char *path = getenv("FASTCHAIN_NVTX_LOG");
    if (!cb || !path) return 0;
    out = fopen(path, "a");
    if (!out) return 0;
    if (!cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &t, &n) || !t) return 0;
    *t[NVTX_CBID_CORE2_DomainCreateA] = (NvtxFunctionPointer)domain_create;
    *t[NVTX_CBID_CORE2_DomainDestroy] = (NvtxFunctionPointer)domain_destroy;
    *t[NVTX_CBID_CORE2_DomainRegisterStringA] = (NvtxFunctionPointer)register_string;
    *t[NVTX_CBID_CORE2_DomainNameCategoryA] = (NvtxFunctionPointer)name_category;
    *t[NVTX_CBID_CORE2_DomainMarkEx] = (NvtxFunctionPointer)mark;
    *t[NVTX_CBID_CORE2_DomainRangePushEx] = (NvtxFunctionPointer)push;
    *t[NVTX_CBID_CORE2_DomainRangePop] = (NvtxFunctionPointer)pop;
    *t[NVTX_CBID_CORE2_DomainRangeStartEx] = (NvtxFunctionPointer)start;
    *t[NVTX_CBID_CORE2_DomainRangeEnd] = (NvtxFunctionPointer)end;
    if (cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &t, &n) && t) {
        *t[NVTX_CBID_CORE_RangePushEx] = (NvtxFunctionPointer)core_push;
        *t[NVTX_CBID_CORE_RangePop] = (NvtxFunctionPointer)core_pop;
        *t[NVTX_CBID_CORE_MarkEx] = (NvtxFunctionPointer)core_mark;
    }
    return 1;
}
