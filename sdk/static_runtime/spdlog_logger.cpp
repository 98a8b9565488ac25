// spdlog's compiled logger (part of what libspdlog.so holds), for programs and
// plugins built with the static runtime: what a call on a logger runs. With
// SPDLOG_COMPILED_LIB the headers only declare it; the -inl.h files define
// it. A plugin needs no more than this: the sinks it writes to are its
// host's (spdlog_sinks.cpp).
#include <spdlog/common-inl.h>
#include <spdlog/details/backtracer-inl.h>
#include <spdlog/details/log_msg-inl.h>
#include <spdlog/details/log_msg_buffer-inl.h>
#include <spdlog/details/os-inl.h>
#include <spdlog/logger-inl.h>
