// Stub for the syntax check of csrc/npu (see ../README.md).
#pragma once
typedef void* aclrtStream;
