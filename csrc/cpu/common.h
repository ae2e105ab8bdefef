// Helpers shared by the CPU kernels in this folder. Each kernel .cpp is compiled once per CPU
// capability (see setup.py); keep file-local helpers in an anonymous namespace.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "checks.h"
