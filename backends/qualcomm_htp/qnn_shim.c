/* A pass-through libQnnHtp.so for ExecuTorch 1.5.1 (QNN 2.37 API) on QNN 2.51's HTP library.
 *
 * ExecuTorch writes the HTP device custom config (QnnHtpDevice_CustomConfig_t: a 4-byte option,
 * then a union) with its payload at byte 4, the 2.37 layout. QNN 2.51's union is 8-byte aligned
 * and read at byte 8, so the SoC arrives as 0 ("unknown custom config socModel 0", error 14001).
 * This library loads the real one (path in QNN_SHIM_REAL_HTP), hands out copies of its
 * interface providers whose deviceCreate rewrites each custom config to the 2.51 layout, and
 * forwards everything else untouched.
 *
 * Layout facts (QnnInterface.h, QnnDevice.h): QnnInterface_t = { uint32 backendId; const char*
 * providerName; Qnn_ApiVersion_t (two 3×uint32 versions) } then the function table at byte 40;
 * deviceCreate is the table's 41st pointer (index 40). QnnDevice_Config_t = { enum option;
 * union at byte 8 }, option 0 = QNN_DEVICE_CONFIGOPTION_CUSTOM.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TABLE_OFFSET 40
#define DEVICE_CREATE_SLOT 40
#define TABLE_SLOTS 64 /* pointers copied from the real table: more than the 2.37 API reads */
#define CONFIG_OPTION_CUSTOM 0
#define MAX_CONFIGS 64

typedef uint64_t (*DeviceCreateFn)(void *logger, const void **config, void **device);
typedef uint64_t (*GetProvidersFn)(const void ***providers, uint32_t *count);

typedef struct {
    uint32_t option;
    uint32_t pad;
    void *custom;
} DeviceConfig; /* QnnDevice_Config_t, custom-config member of its union */

typedef struct {
    uint32_t option;
    uint32_t pad;
    uint8_t payload[8];
} HtpCustomConfig251; /* QnnHtpDevice_CustomConfig_t as QNN 2.51 reads it */

static DeviceCreateFn real_device_create;
static unsigned char *copies;
static const void **copy_list;

static uint64_t device_create(void *logger, const void **config, void **device) {
    DeviceConfig configs[MAX_CONFIGS];
    HtpCustomConfig251 customs[MAX_CONFIGS];
    const void *list[MAX_CONFIGS + 1];
    size_t n = 0;
    for (; config && config[n] && n < MAX_CONFIGS; n++) {
        configs[n] = *(const DeviceConfig *)config[n];
        if (configs[n].option == CONFIG_OPTION_CUSTOM && configs[n].custom) {
            const uint8_t *old = configs[n].custom;
            memset(&customs[n], 0, sizeof customs[n]);
            memcpy(&customs[n].option, old, 4);
            memcpy(customs[n].payload, old + 4, 8);
            configs[n].custom = &customs[n];
        }
        list[n] = &configs[n];
    }
    list[n] = NULL;
    return real_device_create(logger, config ? list : NULL, device);
}

uint64_t QnnInterface_getProviders(const void ***providers, uint32_t *count) {
    const char *path = getenv("QNN_SHIM_REAL_HTP");
    void *real = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
    GetProvidersFn get = real ? (GetProvidersFn)dlsym(real, "QnnInterface_getProviders") : NULL;
    if (!get) {
        fprintf(stderr, "npumoe QNN shim: cannot load QNN_SHIM_REAL_HTP=%s (%s)\n", path ? path : "(unset)", dlerror());
        return 1;
    }
    const void **real_list = NULL;
    uint64_t err = get(&real_list, count);
    if (err || !*count) return err;
    size_t size = TABLE_OFFSET + TABLE_SLOTS * sizeof(void *);
    if (!copies) {
        copies = calloc(*count, size);
        copy_list = calloc(*count, sizeof(void *));
        for (uint32_t i = 0; i < *count; i++) {
            unsigned char *copy = copies + i * size;
            memcpy(copy, real_list[i], size);
            void **table = (void **)(copy + TABLE_OFFSET);
            real_device_create = (DeviceCreateFn)table[DEVICE_CREATE_SLOT];
            table[DEVICE_CREATE_SLOT] = (void *)device_create;
            copy_list[i] = copy;
        }
    }
    *providers = copy_list;
    return 0;
}
