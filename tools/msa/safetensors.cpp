// safetensors reader/writer. The format: an 8-byte little-endian header length N, N bytes of
// JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}
// (possibly padded with spaces), then the byte buffer the offsets index (relative to its
// start). Tensors must tile the buffer exactly: no overlap, no holes, nothing past the end.
#include "safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <span>
#include <sstream>

#include <nlohmann/json.hpp>

#include "msa/error.h"

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this reader copies bytes as they are");

namespace msa::tool {

namespace {

using nlohmann::json;

// Headers larger than this are refused (as other readers of the format do): a corrupt length
// field must not make us allocate gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;
// A valid header nests 3 levels ({name: {"shape": [..]}}); the JSON parser recurses once per
// level, so a hostile header nested tens of thousands deep would overflow the stack. Deeper
// headers are refused by a flat scan before the parser runs.
constexpr int kMaxHeaderDepth = 16;

template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

[[noreturn]] void bad_file(const std::string& path, const std::string& what) {
  throw Error(ErrorKind::invalid_argument, cat(path, ": ", what));
}

// Refuses headers nested deeper than kMaxHeaderDepth; strings (with their escapes) are skipped
// so that brackets inside names and values do not count.
void check_nesting(const std::string& path, const std::string& text) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxHeaderDepth)
        bad_file(path, cat("header nests JSON arrays / objects more than ", kMaxHeaderDepth,
                           " levels deep (at byte ", i, " of the header; a safetensors header needs 3)"));
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Parses the header JSON, rejecting duplicate keys in any object (the last one would win
// silently otherwise, hiding a broken writer).
json parse_header(const std::string& path, const std::string& text) {
  std::vector<std::set<std::string>> keys_per_object;
  std::string duplicate;
  json::parser_callback_t on_event = [&](int, json::parse_event_t event, json& value) {
    if (event == json::parse_event_t::object_start) {
      keys_per_object.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!keys_per_object.empty()) keys_per_object.pop_back();
    } else if (event == json::parse_event_t::key && !keys_per_object.empty()) {
      const std::string key = value.get<std::string>();
      if (!keys_per_object.back().insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text, on_event);
  } catch (const json::exception& e) {
    // The parser's message repeats the token it read, which can be the whole header.
    const std::string why = e.what();
    bad_file(path, cat("header is not valid JSON (", why.size() > 160 ? why.substr(0, 160) + "..." : why, ")"));
  }
  if (!duplicate.empty()) bad_file(path, cat("header holds the key ", quote_short(duplicate), " twice"));
  if (!header.is_object()) bad_file(path, cat("header must be a JSON object, got ", header.type_name()));
  return header;
}

struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

Entry parse_entry(const std::string& path, const std::string& name, const json& info) {
  const std::string where = cat("tensor ", quote_short(name));
  if (!info.is_object()) bad_file(path, cat(where, " must be described by a JSON object, got ", info.type_name()));
  for (const auto& [key, value] : info.items()) {
    (void)value;
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      bad_file(path, cat(where, " has an unknown field ", quote_short(key), " (expected dtype, shape, data_offsets)"));
  }
  Entry e;
  e.name = name;
  if (!info.contains("dtype") || !info["dtype"].is_string()) bad_file(path, cat(where, " needs a string field 'dtype'"));
  try {
    e.dtype = parse_safetensors_dtype(info["dtype"].get<std::string>());
  } catch (const Error& err) {
    bad_file(path, cat(where, ": ", err.what()));
  }

  if (!info.contains("shape") || !info["shape"].is_array()) bad_file(path, cat(where, " needs an array field 'shape'"));
  if (info["shape"].size() > size_t(kMaxRank))
    bad_file(path, cat(where, " has rank ", info["shape"].size(), "; at most ", kMaxRank, " is supported"));
  int64_t numel = 1;
  for (const json& d : info["shape"]) {
    if (!d.is_number_unsigned()) bad_file(path, cat(where, " shape must hold non-negative integers, got ", quote_short(info["shape"].dump())));
    const uint64_t v = d.get<uint64_t>();
    if (v > uint64_t(std::numeric_limits<int32_t>::max()) ||
        (numel > 0 && v > uint64_t(std::numeric_limits<int64_t>::max() / 8) / uint64_t(numel)))
      bad_file(path, cat(where, " shape ", quote_short(info["shape"].dump()), " is too large"));
    e.shape.push_back(int64_t(v));
    numel *= int64_t(v);
  }

  const json& offsets = info.contains("data_offsets") ? info["data_offsets"] : json();
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
    bad_file(path, cat(where, " needs 'data_offsets' = [begin, end] of non-negative integers, got ",
                       info.contains("data_offsets") ? quote_short(offsets.dump()) : std::string("nothing")));
  e.begin = offsets[0].get<uint64_t>();
  e.end = offsets[1].get<uint64_t>();
  if (e.end < e.begin) bad_file(path, cat(where, " data_offsets [", e.begin, ", ", e.end, "] end before they begin"));
  const uint64_t expected = uint64_t(numel) * uint64_t(dtype_size(e.dtype));
  if (e.end - e.begin != expected)
    bad_file(path, cat(where, " data_offsets [", e.begin, ", ", e.end, "] span ", e.end - e.begin, " bytes but ",
                       safetensors_dtype_name(e.dtype), " ", shape_text(e.shape), " needs ", expected));
  return e;
}

std::vector<uint8_t> read_whole_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) bad_file(path, "no such file");
  if (std::filesystem::is_directory(path, ec)) bad_file(path, "is a directory, not a safetensors file");
  std::ifstream in(path, std::ios::binary);
  if (!in) bad_file(path, cat("cannot open for reading (", std::strerror(errno), ")"));
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0) bad_file(path, "cannot determine the file size");
  in.seekg(0, std::ios::beg);
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size)) bad_file(path, "read failed");
  return bytes;
}

}  // namespace

// ---------------------------------------------------------------------------------------

TensorView StTensor::view() const {
  // The tool writes outputs in place, so the view is mutable even through a const tensor.
  return TensorView::contiguous(const_cast<uint8_t*>(bytes.data()), dtype, shape);
}

int64_t StTensor::numel() const { return element_count(shape); }

StTensor make_tensor(std::string name, DType dtype, std::vector<int64_t> shape) {
  StTensor t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.assign(size_t(element_count(t.shape) * dtype_size(dtype)), 0);
  return t;
}

std::string safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::f32: return "F32";
    case DType::i32: return "I32";
    case DType::u8: return "U8";
    case DType::f8e4m3: return "F8_E4M3";
  }
  return "?";
}

DType parse_safetensors_dtype(const std::string& name) {
  for (DType t : {DType::bf16, DType::f16, DType::f32, DType::i32, DType::u8, DType::f8e4m3})
    if (name == safetensors_dtype_name(t)) return t;
  throw Error(ErrorKind::invalid_argument,
              cat("unsupported dtype ", quote_short(name), " (supported: BF16, F16, F32, I32, U8, F8_E4M3)"));
}

std::string quote_short(std::string_view text, size_t max_chars) {
  std::string out = "'";
  size_t shown = 0;
  for (; shown < text.size() && shown < max_chars; ++shown) {
    const auto c = static_cast<unsigned char>(text[shown]);
    if (c >= 0x20 && c < 0x7f) {
      out += char(c);
    } else {  // control bytes and non-ASCII stay readable and cannot corrupt a terminal
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  out += "'";
  if (shown < text.size()) out += cat("... (", text.size(), " characters in all)");
  return out;
}

SafetensorsFile SafetensorsFile::read(const std::string& path) {
  const std::vector<uint8_t> file = read_whole_file(path);
  return parse(file, path);
}

SafetensorsFile SafetensorsFile::parse(std::span<const uint8_t> file, const std::string& path) {
  if (file.size() < 8)
    bad_file(path, cat("truncated: ", file.size(), " bytes, but a safetensors file starts with an 8-byte header length"));
  uint64_t header_len = 0;
  std::memcpy(&header_len, file.data(), 8);
  if (header_len > kMaxHeaderBytes)
    bad_file(path, cat("header length ", header_len, " is larger than the ", kMaxHeaderBytes, "-byte limit (not a safetensors file?)"));
  if (header_len > file.size() - 8)
    bad_file(path, cat("truncated: header length is ", header_len, " bytes but only ", file.size() - 8, " follow"));
  if (header_len < 2) bad_file(path, cat("header length ", header_len, " is too small for a JSON object"));
  const std::string text(reinterpret_cast<const char*>(file.data()) + 8, size_t(header_len));
  if (text[0] != '{') bad_file(path, "header must start with '{'");
  check_nesting(path, text);

  const json header = parse_header(path, text);
  SafetensorsFile out;
  out.path = path;
  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) bad_file(path, cat("__metadata__ must be an object of strings, got ", value.type_name()));
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) bad_file(path, cat("__metadata__ value of ", quote_short(mk), " must be a string, got ", quote_short(mv.dump())));
        out.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, key, value));
  }

  // Tensors must tile the data buffer exactly.
  const uint64_t data_len = file.size() - 8 - header_len;
  std::vector<const Entry*> by_offset;
  for (const Entry& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry* e : by_offset) {
    if (e->end > data_len)
      bad_file(path, cat("tensor ", quote_short(e->name), " data_offsets [", e->begin, ", ", e->end, "] run past the end of the ",
                         data_len, "-byte data section (truncated file?)"));
    if (e->begin < covered)
      bad_file(path, cat("tensor ", quote_short(e->name), " data_offsets [", e->begin, ", ", e->end, "] overlap tensor ",
                         quote_short(previous->name), " [", previous->begin, ", ", previous->end, "]"));
    if (e->begin > covered)
      bad_file(path, cat("data bytes [", covered, ", ", e->begin, ") belong to no tensor (the format allows no holes)"));
    covered = e->end;
    previous = e;
  }
  if (covered != data_len)
    bad_file(path, cat("data section holds ", data_len, " bytes but the tensors cover only ", covered, " (trailing bytes)"));

  const uint8_t* data = file.data() + 8 + header_len;
  for (const Entry& e : entries) {
    StTensor t;
    t.name = e.name;
    t.dtype = e.dtype;
    t.shape = e.shape;
    t.bytes.assign(data + e.begin, data + e.end);
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

const StTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = tensors.find(name);
  return it == tensors.end() ? nullptr : &it->second;
}

const StTensor& SafetensorsFile::get(const std::string& name) const {
  if (const StTensor* t = find(name)) return *t;
  throw Error(ErrorKind::invalid_argument, cat(path, " has no tensor ", quote_short(name)));
}

void write_safetensors(const std::string& path, const std::vector<StTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<const StTensor*> sorted;
  std::set<std::string> names;
  for (const StTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      throw Error(ErrorKind::invalid_argument, cat("write_safetensors: invalid tensor name '", t.name, "'"));
    if (!names.insert(t.name).second)
      throw Error(ErrorKind::invalid_argument, cat("write_safetensors: tensor '", t.name, "' given twice"));
    if (t.shape.size() > size_t(kMaxRank))
      throw Error(ErrorKind::invalid_argument, cat("write_safetensors: tensor '", t.name, "' has rank ", t.shape.size()));
    for (int64_t d : t.shape)
      if (d < 0) throw Error(ErrorKind::invalid_argument, cat("write_safetensors: tensor '", t.name, "' has shape ", shape_text(t.shape)));
    const int64_t expected = t.numel() * dtype_size(t.dtype);
    if (int64_t(t.bytes.size()) != expected)
      throw Error(ErrorKind::invalid_argument, cat("write_safetensors: tensor '", t.name, "' holds ", t.bytes.size(),
                                                   " bytes but ", safetensors_dtype_name(t.dtype), " ",
                                                   shape_text(t.shape), " needs ", expected));
    sorted.push_back(&t);
  }
  std::sort(sorted.begin(), sorted.end(), [](const StTensor* a, const StTensor* b) { return a->name < b->name; });

  json header = json::object();
  if (!metadata.empty()) {
    json meta = json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = meta;
  }
  uint64_t offset = 0;
  for (const StTensor* t : sorted) {
    const uint64_t size = t->bytes.size();
    header[t->name] = {{"dtype", safetensors_dtype_name(t->dtype)},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + size}}};
    offset += size;
  }
  std::string text = header.dump();
  // Pad with spaces so the data starts 8-byte aligned (allowed by the format).
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_len = text.size();

  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path temp = target.parent_path() / (target.filename().string() + ".tmp." + std::to_string(::getpid()));
  auto fail = [&](const std::string& what) {
    std::error_code ec;
    fs::remove(temp, ec);
    throw Error(ErrorKind::invalid_argument, cat(path, ": ", what));
  };
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    if (!out) fail(cat("cannot open ", temp.string(), " for writing (", std::strerror(errno), ")"));
    out.write(reinterpret_cast<const char*>(&header_len), 8);
    out.write(text.data(), std::streamsize(text.size()));
    for (const StTensor* t : sorted) out.write(reinterpret_cast<const char*>(t->bytes.data()), std::streamsize(t->bytes.size()));
    out.flush();
    if (!out) fail(cat("writing ", temp.string(), " failed (disk full?)"));
  }
  std::error_code ec;
  fs::rename(temp, target, ec);
  if (ec) fail(cat("cannot move the finished file into place (", ec.message(), ")"));
}

}  // namespace msa::tool
