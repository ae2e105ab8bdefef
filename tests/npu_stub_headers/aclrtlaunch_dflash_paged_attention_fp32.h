// Stub of the header ascendc_library generates for dflash_paged_attention_fp32: all of them are
// declared in aclrtlaunch_all.h.
#pragma once
#include "aclrtlaunch_all.h"
