// Writes one step's keys and values into their slots of one layer of the paged KV cache,
// in place, for XLA:CPU (`cpu_kv_write.py` builds and registers it). Same result as
// `reference.update_kv_cache`'s scatter, for a cache of any element type.
//
// Why it exists: XLA:CPU has no scatter of a bfloat16 or fp8 buffer; it widens the whole
// cache to a type it has (float32 or float16), scatters, and narrows it back: two copies
// of the entire cache for every layer of every step (1 GiB of fp8 cache: ~0.9 s a layer).
// Here the new values, already in the cache's type, are copied byte for byte into their
// slots of the cache buffer, which the result aliases.
//
// Layouts (row-major): kv_cache [L, 2, K, num_blocks, S, H]; new_kv [T, 2, K, H] in the
// cache's element type; layer [] (int32); slot_mapping [T] (int32: page * S + offset).
// Indices mean what they mean to the reference's scatter (jnp indexing): a negative page
// or layer counts from the end once, and what is still outside the cache writes nothing.
// (The engine's slots and layers are always inside.)

#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteKV(ffi::AnyBuffer kv_cache, ffi::AnyBuffer new_kv, ffi::Buffer<ffi::S32> layer,
                   ffi::Buffer<ffi::S32> slot_mapping, ffi::Result<ffi::AnyBuffer> out) {
  const auto cache_dims = kv_cache.dimensions(), new_dims = new_kv.dimensions();
  if (cache_dims.size() != 6 || new_dims.size() != 4 || kv_cache.element_type() != new_kv.element_type() ||
      new_dims[1] != 2 || new_dims[2] != cache_dims[2] || new_dims[3] != cache_dims[5] ||
      slot_mapping.element_count() != size_t(new_dims[0]) || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "kv cache write: kv_cache must be [L, 2, K, pages, S, H], new_kv [T, 2, K, H] of "
        "its type, slot_mapping [T], layer one index");
  const int64_t num_layers = cache_dims[0], num_kv_heads = cache_dims[2],
                num_pages = cache_dims[3], block_size = cache_dims[4];
  const int64_t slot_bytes = int64_t(kv_cache.size_bytes() / kv_cache.element_count()) *
                             cache_dims[5];  // one head's H values
  char* cache = static_cast<char*>(out->untyped_data());
  if (cache != kv_cache.untyped_data())  // not aliased: the result starts as the cache
    std::memcpy(cache, kv_cache.untyped_data(), kv_cache.size_bytes());
  int64_t l = layer.typed_data()[0];
  if (l < 0) l += num_layers;
  if (l < 0 || l >= num_layers) return ffi::Error::Success();
  const char* values = static_cast<const char*>(new_kv.untyped_data());
  const int32_t* slots = slot_mapping.typed_data();
  for (int64_t t = 0; t < new_dims[0]; ++t) {
    const int64_t slot = slots[t];
    int64_t page = slot >= 0 ? slot / block_size : -((block_size - 1 - slot) / block_size);
    const int64_t offset = slot - page * block_size;  // floor division's, as jnp's
    if (page < 0) page += num_pages;
    if (page < 0 || page >= num_pages) continue;
    for (int64_t kv = 0; kv < 2; ++kv)
      for (int64_t head = 0; head < num_kv_heads; ++head) {
        const int64_t to = (((l * 2 + kv) * num_kv_heads + head) * num_pages + page) * block_size + offset;
        const int64_t from = (t * 2 + kv) * num_kv_heads + head;
        std::memcpy(cache + to * slot_bytes, values + from * slot_bytes, slot_bytes);
      }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineWriteKV, WriteKV,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // kv_cache
                                  .Arg<ffi::AnyBuffer>()         // new_kv
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .Ret<ffi::AnyBuffer>());       // the cache, written
