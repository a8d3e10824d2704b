// RegionArena over a private jemalloc arena (the default backend; Note [Arena
// backends] in jemalloc_arena.hpp).
#include "jemalloc_arena.hpp"

#include <jemalloc/jemalloc.h>

#include <cstring>
#include <string>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"

// Note [Private jemalloc]
// Linking libjemalloc.so would make jemalloc the malloc of the whole process (its
// malloc/free come before glibc's in symbol lookup), and dlopen() of it fails (it uses
// initial-exec TLS). So the build renames every public symbol of Debian's
// libjemalloc_pic.a to strata_je_<name> (memory/cmake/PrivateJemalloc.cmake) and links
// that copy: strata gets a jemalloc of its own, reached only through the functions below,
// and malloc/new in the process stay glibc's (or the sanitizer's). jemalloc.h is included
// for its types and MALLOCX_* flags only.
extern "C" {
void* strata_je_mallocx(size_t size, int flags);
void strata_je_dallocx(void* ptr, int flags);
size_t strata_je_nallocx(size_t size, int flags);
int strata_je_mallctl(const char* name, void* oldp, size_t* oldlenp, void* newp, size_t newlen);

// Note [Exact extents]
// By default jemalloc grows an arena geometrically ("retain": each time it asks its
// hooks for the next page size class, 80, 96, 112 MiB ... for a 64 MiB buffer, and
// keeps the rest) and keeps freed extents for seconds before giving them back
// (decay). It also pads every large buffer by a page (cache_oblivious: a 64 MiB
// buffer takes 64 MiB + 4 KiB), which this jemalloc (5.3) cannot turn off at run
// time; that page is part of what Note [Host store arena] leaves room for. In a region sized to its budget
// that is fatal: a 1 GiB host tier of 64 MiB chunks ran out of range at 896 MiB in use, jemalloc holding 1.22
// GiB in leftovers too small for a chunk. So this private jemalloc (nobody else's
// malloc; Note [Private jemalloc]) asks for exactly the extent a buffer needs, and
// each arena (RegionArena::create) gives freed extents back at once, where the
// free-range map coalesces them with their neighbours. jemalloc reads this symbol
// (weak in its archive) once, at its initialisation.
extern const char* strata_je_malloc_conf;
const char* strata_je_malloc_conf = "retain:false";
}

namespace strata::memory {

// Note [Extent hooks carve the region]
// jemalloc asks its extent hooks for page-multiple extents (its metadata too: the first
// request is a 2 MiB-aligned "base" block). alloc first-fits an aligned piece from a map
// of free ranges of the region (or the exact `new_addr` range when jemalloc wants to grow
// in place) and never maps memory; dalloc and destroy put ranges back, coalescing
// neighbours. commit reports success (the region is always committed and pinned), and
// decommit/purge are left out (nullptr = opt out), so jemalloc never madvise()s pinned
// pages away. split and merge need no bookkeeping: the map only records free ranges.
struct RegionArena::Hooks {
  extent_hooks_t hooks;  // first member: jemalloc's pointer is also a Hooks*
  RegionArena* self;

  static RegionArena* from(extent_hooks_t* h) { return reinterpret_cast<Hooks*>(h)->self; }

  static void* alloc(extent_hooks_t* h, void* new_addr, size_t size, size_t alignment, bool* zero,
                     bool* commit, unsigned /*arena*/) {
    void* data = from(h)->carve(new_addr, size, alignment);
    if (data == nullptr) return nullptr;
    if (*zero) std::memset(data, 0, size);
    *commit = true;
    return data;
  }
  static bool dalloc(extent_hooks_t* h, void* addr, size_t size, bool /*committed*/, unsigned /*arena*/) {
    from(h)->give_back(addr, size);
    return false;  // done
  }
  static void destroy(extent_hooks_t* h, void* addr, size_t size, bool /*committed*/, unsigned /*arena*/) {
    from(h)->give_back(addr, size);
  }
  static bool commit(extent_hooks_t*, void*, size_t, size_t, size_t, unsigned) { return false; }
  static bool split(extent_hooks_t*, void*, size_t, size_t, size_t, bool, unsigned) { return false; }
  static bool merge(extent_hooks_t*, void*, size_t, void*, size_t, bool, unsigned) { return false; }
};

namespace {
int flags_for(unsigned arena, std::size_t alignment) {
  return static_cast<int>(MALLOCX_ARENA(arena)) | MALLOCX_TCACHE_NONE | MALLOCX_ALIGN(alignment);
}
}  // namespace

RegionArena::RegionArena(std::byte* base, std::size_t bytes)
    : hooks_(new Hooks{}), base_(base), bytes_(bytes) {
  hooks_->hooks.alloc = &Hooks::alloc;
  hooks_->hooks.dalloc = &Hooks::dalloc;
  hooks_->hooks.destroy = &Hooks::destroy;
  hooks_->hooks.commit = &Hooks::commit;
  hooks_->hooks.decommit = nullptr;
  hooks_->hooks.purge_lazy = nullptr;
  hooks_->hooks.purge_forced = nullptr;
  hooks_->hooks.split = &Hooks::split;
  hooks_->hooks.merge = &Hooks::merge;
  hooks_->self = this;
  free_.emplace(reinterpret_cast<std::uintptr_t>(base), bytes);
  reserve_spare_nodes();
}

Result<std::unique_ptr<RegionArena>> RegionArena::create(std::byte* base, std::size_t bytes) {
  STRATA_CHECK(base != nullptr);
  STRATA_CHECK(bytes > 0);
  std::unique_ptr<RegionArena> arena(new RegionArena(base, bytes));
  extent_hooks_t* hooks = &arena->hooks_->hooks;
  unsigned index = 0;
  size_t index_bytes = sizeof(index);
  int err = strata_je_mallctl("arenas.create", &index, &index_bytes, &hooks, sizeof(hooks));
  if (err != 0) {
    return internal_error("pinned host arena: jemalloc arenas.create failed: {} (errno {})",
                          std::strerror(err), err);
  }
  arena->index_ = index;
  arena->created_ = true;
  // Note [Exact extents]: freed extents go back to the region's map at once.
  for (const char* setting : {"dirty_decay_ms", "muzzy_decay_ms"}) {
    const std::string name = fmt::format("arena.{}.{}", index, setting);
    ssize_t decay_ms = 0;
    err = strata_je_mallctl(name.c_str(), nullptr, nullptr, &decay_ms, sizeof(decay_ms));
    if (err != 0) {
      return internal_error("pinned host arena: jemalloc {} = 0 failed: {} (errno {})", name,
                            std::strerror(err), err);
    }
  }
  return arena;
}

RegionArena::~RegionArena() {
  if (created_) {
    const std::string name = fmt::format("arena.{}.destroy", index_);
    int err = strata_je_mallctl(name.c_str(), nullptr, nullptr, nullptr, 0);
    STRATA_CHECK_MSG(err == 0, "jemalloc arena.<i>.destroy failed");
  }
  delete hooks_;
}

std::size_t RegionArena::size_class(std::size_t bytes, std::size_t alignment) const {
  return strata_je_nallocx(bytes, flags_for(index_, alignment));
}

void* RegionArena::allocate(std::size_t bytes, std::size_t alignment) {
  return strata_je_mallocx(bytes, flags_for(index_, alignment));
}

void RegionArena::free(void* data) {
  strata_je_dallocx(data, MALLOCX_TCACHE_NONE);
}

}  // namespace strata::memory
