// strata::Config: settings by key, from code or JSON (docs/config.md).
//
// Note [Config keys]
// One table lists every key with its JSON type and a setter taking text, so that
// set() (used by the C ABI and tests), the JSON loader and keys() cannot drift.
// The loader checks the JSON type against the table before converting (a string
// where a number belongs is "wrong type", named), walks sections in a fixed
// order, and applies optimizer.name before the other optimizer keys, because
// choosing an optimizer resets its hyperparameters to that optimizer's defaults.
#include <cmath>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "strata/common/bytes.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/strata.hpp"

namespace strata {
namespace {

enum class Kind : std::uint8_t { kSize, kNumber, kInteger, kBool, kString, kStringList };

std::string_view kind_name(Kind kind) {
  switch (kind) {
    case Kind::kSize:
      return "a size (a string like \"8GiB\" or a non-negative integer of bytes)";
    case Kind::kNumber:
      return "a number";
    case Kind::kInteger:
      return "a non-negative integer";
    case Kind::kBool:
      return "true or false";
    case Kind::kString:
      return "a string";
    case Kind::kStringList:
      return "a list of strings";
  }
  return "?";
}

Result<double> to_number(std::string_view key, std::string_view text) {
  std::string s(text);
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (...) {
    used = 0;
  }
  if (used == 0 || used != s.size() || !std::isfinite(v)) {
    return invalid_argument("{} = \"{}\": not a finite number", key, text);
  }
  return v;
}

Result<std::uint64_t> to_integer(std::string_view key, std::string_view text) {
  std::string s(text);
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 18) {
    return invalid_argument("{} = \"{}\": not a non-negative integer", key, text);
  }
  return std::stoull(s);
}

Result<bool> to_bool(std::string_view key, std::string_view text) {
  if (text == "true" || text == "1") return true;
  if (text == "false" || text == "0") return false;
  return invalid_argument("{} = \"{}\": use true or false", key, text);
}

using Setter = std::function<Status(Config&, std::string_view key, std::string_view value)>;
struct Key {
  std::string name;
  Kind kind;
  Setter set;
};

Setter size_into(std::uint64_t runtime::Budgets::*field) {
  return [field](Config& c, std::string_view key, std::string_view v) -> Status {
    STRATA_ASSIGN_OR_RETURN(c.runtime.budgets.*field, parse_bytes(v, key));
    return Status::Ok();
  };
}

Setter hyper_float(float kernels::Hyper::*field) {
  return [field](Config& c, std::string_view key, std::string_view v) -> Status {
    STRATA_ASSIGN_OR_RETURN(double d, to_number(key, v));
    c.runtime.hyper.*field = static_cast<float>(d);
    return Status::Ok();
  };
}

Setter hyper_bool(bool kernels::Hyper::*field) {
  return [field](Config& c, std::string_view key, std::string_view v) -> Status {
    STRATA_ASSIGN_OR_RETURN(c.runtime.hyper.*field, to_bool(key, v));
    return Status::Ok();
  };
}

template <typename T, typename Owner>
Setter integer_into(T Owner::*field, Owner runtime::RuntimeOptions::*owner) {
  return [field, owner](Config& c, std::string_view key, std::string_view v) -> Status {
    STRATA_ASSIGN_OR_RETURN(std::uint64_t n, to_integer(key, v));
    if (n > std::numeric_limits<T>::max()) return invalid_argument("{} = {}: too large", key, n);
    (c.runtime.*owner).*field = static_cast<T>(n);
    return Status::Ok();
  };
}

// The configuration keys, one table built section by section (each add_* below).
// device.*: the device's kind, budget, copy rates and streams.
void add_device_keys(std::vector<Key>& k) {
  for (const char* d : {"budget", "h2d_bandwidth", "d2h_bandwidth", "d2d_bandwidth"}) {
    k.push_back({fmt::format("device.{}", d), Kind::kSize,
                 [d](Config& c, std::string_view, std::string_view v) { return c.device.set(d, v); }});
  }
  for (const char* d : {"stream_queue_depth", "streams_max", "cuda_ordinal"}) {
    k.push_back({fmt::format("device.{}", d), Kind::kInteger,
                 [d](Config& c, std::string_view, std::string_view v) { return c.device.set(d, v); }});
  }
  k.push_back({"device.kind", Kind::kString,
               [](Config& c, std::string_view, std::string_view v) { return c.device.set("kind", v); }});
}

// budgets.* and nvme.*: each tier's cap and the NVMe tier's place.
void add_storage_keys(std::vector<Key>& k) {
  k.push_back({"budgets.gpu", Kind::kSize, size_into(&runtime::Budgets::gpu_bytes)});
  k.push_back({"budgets.host", Kind::kSize, size_into(&runtime::Budgets::host_bytes)});
  k.push_back({"budgets.nvme", Kind::kSize, size_into(&runtime::Budgets::nvme_bytes)});
  k.push_back(
      {"nvme.dirs", Kind::kStringList, [](Config& c, std::string_view key, std::string_view v) -> Status {
         c.runtime.nvme_dirs.clear();
         std::string s(v);
         std::stringstream in(s);
         for (std::string dir; std::getline(in, dir, ',');) {
           if (dir.empty()) return invalid_argument("{} = \"{}\": an empty directory name", key, v);
           c.runtime.nvme_dirs.push_back(dir);
         }
         return Status::Ok();
       }});
  k.push_back(
      {"nvme.engine", Kind::kString, [](Config& c, std::string_view key, std::string_view v) -> Status {
         if (v != "auto" && v != "uring" && v != "posix")
           return invalid_argument("{} = \"{}\": use auto, uring or posix", key, v);
         c.runtime.io_engine = std::string(v);
         return Status::Ok();
       }});
}

// optimizer.*: the optimizer and its hyperparameters.
void add_optimizer_keys(std::vector<Key>& k) {
  k.push_back(
      {"optimizer.name", Kind::kString, [](Config& c, std::string_view key, std::string_view v) -> Status {
         auto o = kernels::parse_optimizer(v);
         if (!o.ok()) return Status(o.status()).with_context(key);
         c.runtime.hyper = kernels::optimizer_defaults(*o);
         return Status::Ok();
       }});
  using H = kernels::Hyper;
  const std::pair<const char*, float H::*> floats[] = {{"lr", &H::lr},
                                                       {"beta1", &H::beta1},
                                                       {"beta2", &H::beta2},
                                                       {"beta3", &H::beta3},
                                                       {"eps", &H::eps},
                                                       {"eps2", &H::eps2},
                                                       {"weight_decay", &H::weight_decay},
                                                       {"momentum", &H::momentum},
                                                       {"dampening", &H::dampening},
                                                       {"trust_coefficient", &H::trust_coefficient},
                                                       {"lr_decay", &H::lr_decay},
                                                       {"clip_threshold", &H::clip_threshold}};
  for (const auto& [name, field] : floats)
    k.push_back({fmt::format("optimizer.{}", name), Kind::kNumber, hyper_float(field)});
  for (const auto& [name, field] : {std::pair<const char*, bool H::*>{"nesterov", &H::nesterov},
                                    {"bias_correction", &H::bias_correction},
                                    {"lars_clip", &H::lars_clip}})
    k.push_back({fmt::format("optimizer.{}", name), Kind::kBool, hyper_bool(field)});
}

// precision.*, clipping, loss scaling, threads and the timeline.
void add_step_keys(std::vector<Key>& k) {
  k.push_back(
      {"precision.compute", Kind::kString, [](Config& c, std::string_view key, std::string_view v) -> Status {
         auto d = runtime::parse_dtype(v);
         if (!d.ok() || *d == runtime::DType::kQ8)
           return invalid_argument("{} = \"{}\": use fp32, bf16 or fp16", key, v);
         c.runtime.compute_dtype = *d;
         return Status::Ok();
       }});
  k.push_back(
      {"precision.states", Kind::kString, [](Config& c, std::string_view key, std::string_view v) -> Status {
         auto d = runtime::parse_dtype(v);
         if (!d.ok() || *d == runtime::DType::kF16)
           return invalid_argument("{} = \"{}\": use fp32, bf16 or q8 (q8: 8-bit adam/adamw states)", key, v);
         c.runtime.state_dtype = *d;
         return Status::Ok();
       }});
  k.push_back(
      {"clip_max_norm", Kind::kNumber, [](Config& c, std::string_view key, std::string_view v) -> Status {
         STRATA_ASSIGN_OR_RETURN(c.runtime.clip_max_norm, to_number(key, v));
         if (c.runtime.clip_max_norm < 0) return invalid_argument("{} = {}: must be >= 0 (0 = off)", key, v);
         return Status::Ok();
       }});
  k.push_back(
      {"loss_scaling", Kind::kBool, [](Config& c, std::string_view key, std::string_view v) -> Status {
         STRATA_ASSIGN_OR_RETURN(c.runtime.loss_scaling, to_bool(key, v));
         return Status::Ok();
       }});
  k.push_back({"threads", Kind::kInteger, [](Config& c, std::string_view key, std::string_view v) -> Status {
                 STRATA_ASSIGN_OR_RETURN(std::uint64_t n, to_integer(key, v));
                 if (n > 4096) return invalid_argument("{} = {}: at most 4096 (0 = one per core)", key, n);
                 c.runtime.threads = n;
                 return Status::Ok();
               }});
  k.push_back({"timeline_events_max", Kind::kInteger,
               [](Config& c, std::string_view key, std::string_view v) -> Status {
                 STRATA_ASSIGN_OR_RETURN(std::uint64_t n, to_integer(key, v));
                 if (n == 0 || n > (1u << 24)) return invalid_argument("{} = {}: use 1 .. 16777216", key, n);
                 c.runtime.timeline_events_max = n;
                 return Status::Ok();
               }});
}

// plan.* and layout.*: the planner's knobs and the chunk size.
void add_plan_keys(std::vector<Key>& k) {
  k.push_back(
      {"plan.prefetch", Kind::kBool, [](Config& c, std::string_view key, std::string_view v) -> Status {
         STRATA_ASSIGN_OR_RETURN(c.runtime.plan.prefetch, to_bool(key, v));
         return Status::Ok();
       }});
  using P = runtime::PlanOptions;
  for (const auto& [name, field] :
       {std::pair<const char*, std::uint32_t P::*>{"prefetch_depth_max", &P::prefetch_depth_max},
        {"nvme_families_in_flight", &P::nvme_families_in_flight},
        {"grad_staging_slots", &P::grad_staging_slots},
        {"micro_batches", &P::micro_batches},
        {"deferred_updates", &P::deferred_updates}})
    k.push_back(
        {fmt::format("plan.{}", name), Kind::kInteger, integer_into(field, &runtime::RuntimeOptions::plan)});
  k.push_back(
      {"plan.host_reserve", Kind::kSize, [](Config& c, std::string_view key, std::string_view v) -> Status {
         STRATA_ASSIGN_OR_RETURN(c.runtime.plan.host_reserve_bytes, parse_bytes(v, key));
         return Status::Ok();
       }});
  using L = runtime::LayoutOptions;
  for (const auto& [name, field] :
       {std::pair<const char*, std::uint64_t L::*>{"chunk_elems", &L::chunk_elems},
        {"chunk_elems_min", &L::chunk_elems_min},
        {"chunk_elems_max", &L::chunk_elems_max}})
    k.push_back({fmt::format("layout.{}", name), Kind::kInteger,
                 integer_into(field, &runtime::RuntimeOptions::layout)});
}

const std::vector<Key>& table() {
  static const std::vector<Key> keys = [] {
    std::vector<Key> k;
    add_device_keys(k);
    add_storage_keys(k);
    add_optimizer_keys(k);
    add_step_keys(k);
    add_plan_keys(k);
    return k;
  }();
  return keys;
}

const Key* find(std::string_view name) {
  for (const Key& k : table()) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

Status unknown_key(std::string_view name) {
  const std::size_t dot = name.find('.');
  const std::string section(dot == std::string_view::npos ? "" : name.substr(0, dot + 1));
  std::string known;
  for (const Key& k : table()) {
    if (!section.empty() && k.name.rfind(section, 0) != 0) continue;
    known += (known.empty() ? "" : ", ") + k.name;
  }
  if (known.empty()) {  // an unknown section: list them all
    for (const Key& k : table()) known += (known.empty() ? "" : ", ") + k.name;
  }
  return invalid_argument("unknown setting \"{}\"; known: {}", name, known);
}

// A JSON value for a message: scalars as text (at most 80 characters), arrays and
// objects by their size only (dump() would recurse as deep as the text nests).
std::string brief(const nlohmann::json& v) {
  if (v.is_structured()) return fmt::format("of {} elements", v.size());
  std::string text = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

// The JSON value as set() text, after checking its type against the key's kind.
Result<std::string> json_text(const Key& key, const nlohmann::json& v) {
  auto wrong = [&] {
    return invalid_argument("{}: wrong type ({} {}); expected {}", key.name, v.type_name(), brief(v),
                            kind_name(key.kind));
  };
  switch (key.kind) {
    case Kind::kSize:
      if (v.is_string()) return v.get<std::string>();
      if (v.is_number_unsigned()) return std::to_string(v.get<std::uint64_t>());
      if (v.is_number())
        return invalid_argument(
            "{} = {}: a size must be a non-negative whole number of bytes or a string like "
            "\"8GiB\"",
            key.name, brief(v));
      return wrong();
    case Kind::kNumber:
      if (v.is_number()) return fmt::format("{}", v.get<double>());
      return wrong();
    case Kind::kInteger:
      if (v.is_number_unsigned()) return std::to_string(v.get<std::uint64_t>());
      if (v.is_number_integer())
        return invalid_argument("{} = {}: must be a non-negative integer", key.name, brief(v));
      return wrong();
    case Kind::kBool:
      if (v.is_boolean()) return std::string(v.get<bool>() ? "true" : "false");
      return wrong();
    case Kind::kString:
      if (v.is_string()) return v.get<std::string>();
      return wrong();
    case Kind::kStringList: {
      if (!v.is_array()) return wrong();
      std::string out;
      for (const auto& e : v) {
        if (!e.is_string()) return wrong();
        const std::string s = e.get<std::string>();
        if (s.find(',') != std::string::npos)
          return invalid_argument("{}: directory \"{}\" contains a comma, which strata does not accept",
                                  key.name, s);
        out += (out.empty() ? "" : ",") + s;
      }
      return out;
    }
  }
  return wrong();
}

Status apply(Config& c, const std::string& name, const nlohmann::json& v) {
  const Key* key = find(name);
  if (key == nullptr) {
    // The root and its sections are objects; nothing deeper is (so the recursion
    // is two levels at most, whatever the nesting of the text).
    if (v.is_object() && name.find('.') == std::string::npos) {
      // A section: its keys, optimizer.name first (Note [Config keys]).
      if (auto it = v.find("name"); it != v.end() && name == "optimizer") {
        STRATA_RETURN_IF_ERROR(apply(c, name + ".name", *it));
      }
      for (const auto& [k, sub] : v.items()) {
        if (name == "optimizer" && k == "name") continue;
        STRATA_RETURN_IF_ERROR(apply(c, name.empty() ? k : name + "." + k, sub));
      }
      return Status::Ok();
    }
    return unknown_key(name);
  }
  STRATA_ASSIGN_OR_RETURN(std::string text, json_text(*key, v));
  return key->set(c, key->name, text);
}

}  // namespace

Config::Config() {
  runtime.hyper = kernels::optimizer_defaults(kernels::Optimizer::kAdamW);
  runtime.budgets = {.gpu_bytes = 1 * kGiB, .host_bytes = 4 * kGiB, .nvme_bytes = 0};
}

Status Config::set(std::string_view key, std::string_view value) {
  const Key* k = find(key);
  if (k == nullptr) return unknown_key(key);
  return k->set(*this, k->name, value);
}

Status Config::update_from_json_text(std::string_view text) {
  nlohmann::json j =
      nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (j.is_discarded()) {
    return invalid_argument("config: not valid JSON (check commas, quotes and braces)");
  }
  if (!j.is_object())
    return invalid_argument("config: the top level must be a JSON object, got {}", j.type_name());
  Config c = *this;  // all or nothing: a refused key leaves *this as it was
  STRATA_RETURN_IF_ERROR(apply(c, "", j));
  *this = std::move(c);
  return Status::Ok();
}

Result<Config> Config::from_json_text(std::string_view text) {
  Config c;
  STRATA_RETURN_IF_ERROR(c.update_from_json_text(text));
  return c;
}

Status Config::update_from_json_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return not_found("config file {}: no such file", path.string());
  if (!std::filesystem::is_regular_file(path, ec) || std::filesystem::file_size(path, ec) > kConfigBytesMax) {
    return invalid_argument("config file {}: not a regular file of at most {}", path.string(),
                            format_bytes(kConfigBytesMax));
  }
  std::ifstream in(path);
  if (!in) return permission_denied("config file {}: cannot be opened for reading", path.string());
  std::stringstream buffer;
  buffer << in.rdbuf();
  Status s = update_from_json_text(buffer.str());
  if (!s.ok()) return s.with_context(fmt::format("config file {}", path.string()));
  return Status::Ok();
}

Result<Config> Config::from_json_file(const std::filesystem::path& path) {
  Config c;
  STRATA_RETURN_IF_ERROR(c.update_from_json_file(path));
  return c;
}

std::vector<std::string> Config::keys() {
  std::vector<std::string> out;
  for (const Key& k : table()) out.push_back(k.name);
  return out;
}

}  // namespace strata
