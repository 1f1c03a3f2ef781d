// Run-time choice of the CPU kernels by the CPU's features (see NOTE: [CPU levels] and
// docs/build.md): the kernels are compiled once per level (cpu_kernels.cpp); each level records
// the entry points of register_kernels (op_entries.h) into a KernelTable, and the dispatcher's
// CPU kernels are forwarders that call the active table's entry.
#pragma once

#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

namespace peak {
namespace cpu_dispatch {

// The entry points of one level, in register_kernels' order (names kept to check that order).
struct KernelTable {
  std::vector<const char*> names;
  std::vector<void*> entries;
};

// Takes register_kernels' impl(name, &entry) calls and records them.
struct TableRecorder {
  KernelTable& table;
  template <typename R, typename... A>
  void impl(const char* name, R (*entry)(A...)) {
    table.names.push_back(name);
    table.entries.push_back(reinterpret_cast<void*>(entry));
  }
};

// The table in use: chosen on first use from PEAK_CPU_LEVEL or the CPU's features, then kept
// (set_level, for tests, replaces it). Throws std::runtime_error for a level that cannot run.
const KernelTable& active_table();

// The op names in the order the forwarders were registered (checked against every table).
std::vector<const char*>& registered_names();

// Takes register_kernels' impl(name, &entry) calls and registers, for each, a kernel with the
// entry's signature that calls entry number i of the active table.
struct ForwardingRegistrar {
  torch::Library& lib;
  size_t next = 0;
  template <typename R, typename... A>
  void impl(const char* name, R (*)(A...)) {
    const size_t i = next++;
    registered_names().push_back(name);
    lib.impl(name, [i](A... args) -> R {
      using Entry = R (*)(A...);
      return reinterpret_cast<Entry>(active_table().entries[i])(std::forward<A>(args)...);
    });
  }
};

struct LevelReport {
  std::string active;                  // the level in use
  std::vector<std::string> compiled;   // compiled into this build, lowest first
  std::vector<std::string> supported;  // of those, the ones this CPU runs
  std::string forced;                  // PEAK_CPU_LEVEL's value when it chose the level, else ""
};
LevelReport report();

// Switches the active level (tests: run the same inputs at every level). "auto" = the best
// level this CPU runs. Same checks as PEAK_CPU_LEVEL. Returns the level that was active.
std::string set_level(const std::string& name);

}  // namespace cpu_dispatch
}  // namespace peak
