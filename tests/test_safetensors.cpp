// The safetensors reader/writer of the msa tool: round trips of every dtype and the
// header/data validation that turns broken files into named errors.
#if __has_include("safetensors.h")  // the tool's folder is on the include path only when the tool is built

#include "safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "msa/error.h"

namespace msa::tool {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("msa_st_" + std::to_string(::getpid()) + "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  // Writes a raw file: 8-byte length (default: the header's size), header text, data bytes.
  std::string raw(const std::string& name, const std::string& header, const std::string& data,
                  int64_t length_field = -1) {
    const std::string path = file(name);
    std::ofstream out(path, std::ios::binary);
    const uint64_t n = length_field >= 0 ? uint64_t(length_field) : header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << data;
    return path;
  }

  // Expects reading `path` to throw msa::Error whose message contains every fragment.
  static void expect_error(const std::string& path, std::initializer_list<const char*> fragments) {
    try {
      SafetensorsFile::read(path);
      FAIL() << "reading " << path << " should have failed";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
      const std::string msg = e.what();
      for (const char* f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "message: " << msg << "\nmissing: " << f;
    }
  }

  fs::path dir_;
};

StTensor random_tensor(const std::string& name, DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  StTensor t = make_tensor(name, dtype, std::move(shape));
  std::mt19937 rng(seed);
  for (uint8_t& b : t.bytes) b = uint8_t(rng());
  return t;
}

TEST_F(SafetensorsTest, RoundTripsEveryDtypeShapeAndMetadata) {
  std::vector<StTensor> tensors = {
      random_tensor("q", DType::bf16, {3, 2, 5}, 1),     random_tensor("half", DType::f16, {7}, 2),
      random_tensor("lse", DType::f32, {2, 3}, 3),       random_tensor("cu", DType::i32, {4}, 4),
      random_tensor("bytes", DType::u8, {3, 1, 1}, 5),   random_tensor("fp8", DType::f8e4m3, {5, 3}, 6),
      random_tensor("scalar", DType::f32, {}, 7),        random_tensor("empty", DType::bf16, {0, 128}, 8),
  };
  const std::map<std::string, std::string> meta = {{"init_blocks", "2"}, {"note", "x y \"quoted\""}};
  const std::string path = file("round.safetensors");
  write_safetensors(path, tensors, meta);

  const SafetensorsFile back = SafetensorsFile::read(path);
  EXPECT_EQ(back.metadata, meta);
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (const StTensor& t : tensors) {
    const StTensor& r = back.get(t.name);
    EXPECT_EQ(r.dtype, t.dtype) << t.name;
    EXPECT_EQ(r.shape, t.shape) << t.name;
    EXPECT_EQ(r.bytes, t.bytes) << t.name;
    EXPECT_EQ(r.view().numel(), t.numel()) << t.name;
  }
  EXPECT_EQ(back.get("scalar").numel(), 1);
  EXPECT_EQ(back.get("empty").bytes.size(), 0u);

  // The data section starts 8-byte aligned and the length field is little-endian.
  std::ifstream in(path, std::ios::binary);
  uint8_t len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(fs::file_size(path), 8 + n + 3 * 2 * 5 * 2 + 7 * 2 + 6 * 4 + 4 * 4 + 3 + 15 + 4);
}

TEST_F(SafetensorsTest, DtypeNamesFollowTheFormat) {
  EXPECT_EQ(safetensors_dtype_name(DType::bf16), "BF16");
  EXPECT_EQ(safetensors_dtype_name(DType::f8e4m3), "F8_E4M3");
  EXPECT_EQ(parse_safetensors_dtype("I32"), DType::i32);
  EXPECT_THROW(parse_safetensors_dtype("F64"), Error);
  EXPECT_THROW(parse_safetensors_dtype("bf16"), Error);  // names are case-sensitive
}

TEST_F(SafetensorsTest, ReadsForeignLayoutWithPaddingAndNoMetadata) {
  // Tensors stored in a different order than their names, header padded with spaces.
  const std::string header =
      R"({"b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}   )";
  const std::string data("\x01\x00\x00\x00\xff\xff\xff\xff\x07\x08\x09", 11);
  const SafetensorsFile f = SafetensorsFile::read(raw("foreign.safetensors", header, data));
  EXPECT_TRUE(f.metadata.empty());
  EXPECT_EQ(f.get("b").view().as<int32_t>()[0], 1);
  EXPECT_EQ(f.get("b").view().as<int32_t>()[1], -1);
  EXPECT_EQ(f.get("a").bytes, (std::vector<uint8_t>{7, 8, 9}));
  EXPECT_EQ(f.find("c"), nullptr);
  try {
    f.get("c");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no tensor 'c'"), std::string::npos) << e.what();
  }
}

TEST_F(SafetensorsTest, RejectsMissingAndTruncatedFiles) {
  expect_error(file("absent.safetensors"), {"absent.safetensors", "no such file"});
  expect_error(raw("short.safetensors", "", "", 0), {"too small"});  // only the length field
  {
    const std::string path = file("tiny.safetensors");
    std::ofstream(path, std::ios::binary) << "abc";
    expect_error(path, {"truncated", "3 bytes"});
  }
  expect_error(raw("len.safetensors", "{}", "", 500), {"truncated", "header length is 500"});
  expect_error(raw("huge.safetensors", "{}", "", int64_t(1) << 40), {"larger than"});
  // Data cut short: the header promises 8 bytes, 5 are present.
  expect_error(raw("cut.safetensors", R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "12345"),
               {"tensor 'x'", "run past the end", "truncated"});
}

TEST_F(SafetensorsTest, RejectsBadHeaders) {
  expect_error(raw("json.safetensors", R"({"x": {"dtype": "F32",)", ""), {"not valid JSON"});
  expect_error(raw("array.safetensors", "[1, 2]", ""), {"must start with '{'"});
  expect_error(raw("dup.safetensors", R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"x":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "ab"),
               {"'x' twice"});
  expect_error(raw("dtype.safetensors", R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", "12345678"),
               {"tensor 'x'", "unsupported dtype 'F64'"});
  expect_error(raw("nodtype.safetensors", R"({"x":{"shape":[1],"data_offsets":[0,1]}})", "1"), {"tensor 'x'", "dtype"});
  expect_error(raw("shape.safetensors", R"({"x":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "1"),
               {"tensor 'x'", "non-negative integers"});
  expect_error(raw("field.safetensors", R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":1}})", "1"),
               {"unknown field 'extra'"});
  expect_error(raw("meta.safetensors", R"({"__metadata__":{"init_blocks":2}})", ""),
               {"__metadata__ value of 'init_blocks' must be a string"});
  expect_error(raw("offs.safetensors", R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", "1"), {"data_offsets"});
}

TEST_F(SafetensorsTest, RejectsOffsetsThatDoNotTileTheData) {
  expect_error(raw("size.safetensors", R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "1234"),
               {"tensor 'x'", "span 4 bytes", "needs 8"});
  expect_error(raw("range.safetensors", R"({"x":{"dtype":"U8","shape":[2],"data_offsets":[10,12]}})", "12"),
               {"tensor 'x'", "[10, 12]", "past the end"});
  expect_error(raw("back.safetensors", R"({"x":{"dtype":"U8","shape":[0],"data_offsets":[2,1]}})", "12"),
               {"end before they begin"});
  expect_error(raw("overlap.safetensors",
                   R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                   "1234"),
               {"tensor 'b'", "overlap tensor 'a'"});
  expect_error(raw("hole.safetensors",
                   R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})",
                   "123"),
               {"[1, 2) belong to no tensor"});
  expect_error(raw("trail.safetensors", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "12"),
               {"trailing bytes"});
}

TEST_F(SafetensorsTest, FailedWriteLeavesExistingFileUntouched) {
  const std::string path = file("out.safetensors");
  write_safetensors(path, {random_tensor("a", DType::u8, {4}, 9)});
  const auto before = fs::file_size(path);

  StTensor broken = make_tensor("b", DType::f32, {4});
  broken.bytes.resize(3);  // does not match its shape
  EXPECT_THROW(write_safetensors(path, {broken}), Error);
  EXPECT_THROW(write_safetensors(path, {random_tensor("a", DType::u8, {1}, 1), random_tensor("a", DType::u8, {1}, 2)}),
               Error);
  EXPECT_EQ(fs::file_size(path), before);
  EXPECT_EQ(SafetensorsFile::read(path).get("a").bytes.size(), 4u);

  EXPECT_THROW(write_safetensors(file("no/such/dir/x.safetensors"), {random_tensor("a", DType::u8, {1}, 1)}), Error);
  // No temporary files are left behind.
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir_)) entries += e.is_regular_file();
  EXPECT_EQ(entries, 1);
}

// Hostile headers: nesting deep enough to overflow a recursive parser (or a recursive dump in
// the error message) must give a clean error, checked before any recursion runs.
TEST_F(SafetensorsTest, DeeplyNestedHeaderValuesAreRefusedBeforeParsing) {
  const std::string deep = std::string(60000, '[') + std::string(60000, ']');
  const std::string tensor = R"("a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]})";
  for (const std::string& header :
       {"{\"__metadata__\":{\"x\":" + deep + "}," + tensor + "}",
        R"({"a":{"dtype":"U8","shape":)" + deep + R"(,"data_offsets":[0,1]}})",
        R"({"a":{"dtype":"U8","shape":[1],"data_offsets":)" + deep + "}}"}) {
    const std::string path = raw("deep.safetensors", header, "1");
    try {
      SafetensorsFile::read(path);
      FAIL() << "a 60,000-deep header was accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("nests JSON arrays / objects more than 16 levels deep"), std::string::npos) << msg;
      EXPECT_LT(msg.size(), 400u) << "the message must not echo the value";
    }
  }
  // Brackets inside strings are not nesting: such a name is read.
  const std::string name = std::string(100, '[') + "\\\"{";
  const std::string path = raw("brackets.safetensors", "{\"" + name + R"(":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "1");
  EXPECT_EQ(SafetensorsFile::read(path).tensors.size(), 1u);
}

TEST_F(SafetensorsTest, MessagesQuoteOnlyAShortPrefixOfNamesAndValues) {
  const std::string long_name(1000000, 'n');
  auto expect_short = [&](const std::string& path, const char* fragment) {
    try {
      SafetensorsFile::read(path);
      FAIL() << "should have failed: " << fragment;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_LT(msg.size(), 400u) << msg.substr(0, 400);
      EXPECT_NE(msg.find(fragment), std::string::npos) << msg.substr(0, 400);
    }
  };
  expect_short(raw("name.safetensors", "{\"" + long_name + R"(":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})",
                   "12345678"),
               "(1000000 characters in all)");
  expect_short(raw("dtype.safetensors", R"({"a":{"dtype":")" + long_name + R"(","shape":[1],"data_offsets":[0,1]}})", "1"),
               "unsupported dtype 'nnnn");
  std::string big_array = "[";
  for (int i = 0; i < 20000; ++i) big_array += (i ? ",1" : "1");
  big_array += "]";
  expect_short(raw("meta.safetensors", R"({"__metadata__":{"k":)" + big_array + "}}", ""), "must be a string, got '[1,1,1");
  expect_short(raw("shape.safetensors", R"({"a":{"dtype":"U8","shape":)" + big_array + R"(,"data_offsets":[0,1]}})", "1"),
               "has rank 20000");
  // The parser's own message repeats the token it stopped at: an unterminated long string.
  expect_short(raw("json.safetensors", "{\"" + long_name, ""), "header is not valid JSON");
}

TEST_F(SafetensorsTest, QuoteShortEscapesAndCuts) {
  EXPECT_EQ(quote_short("q"), "'q'");
  EXPECT_EQ(quote_short(std::string("a\nb\x01\xff", 5)), "'a\\x0ab\\x01\\xff'");
  EXPECT_EQ(quote_short(std::string(100, 'x'), 4), "'xxxx'... (100 characters in all)");
}

TEST_F(SafetensorsTest, ParseFromMemoryMatchesRead) {
  const std::string path = file("mem.safetensors");
  write_safetensors(path, {random_tensor("a", DType::bf16, {2, 3}, 1)}, {{"mode", "training"}});
  std::ifstream in(path, std::ios::binary);
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const SafetensorsFile f = SafetensorsFile::parse(bytes, "in memory");
  EXPECT_EQ(f.metadata.at("mode"), "training");
  EXPECT_EQ(f.get("a").bytes, SafetensorsFile::read(path).get("a").bytes);
  EXPECT_THROW(SafetensorsFile::parse(std::span<const uint8_t>(bytes.data(), 12), "cut"), Error);
}

}  // namespace
}  // namespace msa::tool

#endif  // __has_include("safetensors.h")
