// TensorFlow kernels for tf_dataset's short-circuit reads: cached blocks are read straight from
// the worker's block files and verified with the xxh3_64 the worker gave for each, in C++,
// without the GIL and with one copy (file -> output tensor), as tf.io.read_file does.
//
// CachefsReadFiles: the contents of a chunk of files. A file marked local is read from its
//   block files; if any of them is missing, short, or fails its checksum, the whole file is read
//   through the mount instead (never mixed) and `fell_back` says so. Other files are read
//   through the mount (<mount_root>/<name>).
// CachefsReadTfRecordBlock: one block of a TFRecord shard, verified, after the incomplete record
//   carried over from the blocks before it: the whole records they hold, and the new carry.
//   `ok` is false (no records, the carry unchanged) if the block fails: the caller reads the
//   rest of the shard through the mount. Record framing is checked like TensorFlow's own
//   reader (masked crc32c of length and data): a bad record is DataLoss, as there.
//
// The Python reference of CachefsReadFiles is tf_dataset/reader.py's read_chunk, with the same
// arguments; tests run both engines over the same files.

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "xla/tsl/lib/hash/crc32c.h"

// Debian's libxxhash is built with runtime dispatch (AVX2/AVX-512 where the CPU has them):
// several times faster than the SSE2 baseline a portable build compiles to.
#include <xxhash.h>
#if defined(__x86_64__) && __has_include(<xxh_x86dispatch.h>)
#include <xxh_x86dispatch.h>
#define CACHEFS_XXH3_64 XXH3_64bits_dispatch
#else
#define CACHEFS_XXH3_64 XXH3_64bits
#endif

namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::tstring;
namespace shape_inference = ::tensorflow::shape_inference;

class Fd {  // closes on every path out
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Reads exactly `length` bytes from the start of `path` into `dest`. False if the file cannot
// be opened or read, or is shorter. Bytes past `length` are not read: they cannot change what
// is returned.
bool ReadExactly(const std::string& path, char* dest, int64_t length) {
  if (path.find('\0') != std::string::npos) return false;  // open() would stop at the NUL
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return false;
  int64_t done = 0;
  while (done < length) {
    ssize_t got = pread(fd.get(), dest + done, length - done, done);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;  // an error, or the file is short
    done += got;
  }
  return true;
}

bool Verified(const char* data, int64_t length, int64_t checksum) {
  return CACHEFS_XXH3_64(data, static_cast<size_t>(length)) == static_cast<uint64_t>(checksum);
}

// A file's bytes from its block files [first, last) into `out`, each block verified.
bool ReadBlocks(const tensorflow::TTypes<tstring>::ConstFlat& files,
                const tensorflow::TTypes<int64_t>::ConstFlat& lengths,
                const tensorflow::TTypes<int64_t>::ConstFlat& checksums, int64_t first,
                int64_t last, tstring* out) {
  int64_t total = 0;
  for (int64_t b = first; b < last; ++b) total += lengths(b);
  out->resize_uninitialized(total);
  char* dest = out->mdata();
  for (int64_t b = first; b < last; ++b) {
    if (!ReadExactly(std::string(files(b)), dest, lengths(b)) ||
        !Verified(dest, lengths(b), checksums(b))) {
      out->clear();
      return false;
    }
    dest += lengths(b);
  }
  return true;
}

// A whole file through the mount (its size from fstat; read on to EOF in case it differs).
absl::Status ReadWholeFile(const std::string& path, tstring* out) {
  if (path.find('\0') != std::string::npos) {  // open() would stop at the NUL: another file
    return absl::InvalidArgumentError("a path holds a NUL byte");
  }
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return tsl::errors::IOError(path, errno);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return tsl::errors::IOError(path, errno);
  int64_t capacity = st.st_size > 0 ? st.st_size : 0;
  out->resize_uninitialized(capacity);
  int64_t done = 0;
  while (true) {
    if (done == capacity) {  // full: grow and try to read more (EOF is the usual answer)
      capacity = capacity ? capacity * 2 : 64 * 1024;
      out->resize(capacity);  // keeps the bytes read so far
    }
    ssize_t got = read(fd.get(), out->mdata() + done, capacity - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return tsl::errors::IOError(path, errno);
    if (got == 0) break;
    done += got;
  }
  out->resize(done);
  return absl::OkStatus();
}

// <mount root>/<name>; leading slashes of the name are ignored (as reader.mount_path_of).
std::string MountPath(const std::string& root, absl::string_view name) {
  while (!name.empty() && name.front() == '/') name.remove_prefix(1);
  std::string path = root;
  if (!path.empty() && path.back() != '/') path += '/';
  path.append(name.data(), name.size());
  return path;
}

absl::Status ValidateBlockTable(const Tensor& files, const Tensor& lengths,
                                const Tensor& checksums) {
  if (files.dims() != 1 || lengths.shape() != files.shape() ||
      checksums.shape() != files.shape()) {
    return absl::InvalidArgumentError(
        "block_files, block_lengths and block_checksums must be vectors of one length");
  }
  auto length = lengths.flat<int64_t>();
  for (int64_t b = 0; b < length.size(); ++b) {
    if (length(b) < 0) return absl::InvalidArgumentError("a block length is negative");
  }
  return absl::OkStatus();
}

class ReadFilesOp : public OpKernel {
 public:
  explicit ReadFilesOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& mount_root = context->input(0);
    const Tensor& names = context->input(1);
    const Tensor& local = context->input(2);
    const Tensor& splits = context->input(3);
    const Tensor& files = context->input(4);
    const Tensor& lengths = context->input(5);
    const Tensor& checksums = context->input(6);
    OP_REQUIRES(context, mount_root.dims() == 0,
                absl::InvalidArgumentError("mount_root must be a scalar"));
    OP_REQUIRES(context, names.dims() == 1 && local.shape() == names.shape(),
                absl::InvalidArgumentError("names and local must be vectors of one length"));
    const int64_t count = names.NumElements();
    OP_REQUIRES(context, splits.dims() == 1 && splits.NumElements() == count + 1,
                absl::InvalidArgumentError("block_splits must have one more item than files"));
    OP_REQUIRES_OK(context, ValidateBlockTable(files, lengths, checksums));
    auto split = splits.flat<int64_t>();
    OP_REQUIRES(context, split(0) == 0 && split(count) == files.NumElements(),
                absl::InvalidArgumentError("block_splits must run from 0 to the block count"));
    for (int64_t i = 0; i < count; ++i) {
      OP_REQUIRES(context, split(i) <= split(i + 1),
                  absl::InvalidArgumentError("block_splits must not decrease"));
    }

    Tensor* contents = nullptr;
    Tensor* fell_back = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({count}), &contents));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({count}), &fell_back));
    auto out = contents->flat<tstring>();
    auto failed = fell_back->flat<bool>();
    const std::string root(mount_root.scalar<tstring>()());
    auto name = names.flat<tstring>();
    auto is_local = local.flat<bool>();
    auto file = files.flat<tstring>();
    auto length = lengths.flat<int64_t>();
    auto checksum = checksums.flat<int64_t>();
    for (int64_t i = 0; i < count; ++i) {
      failed(i) = false;
      if (is_local(i)) {
        if (ReadBlocks(file, length, checksum, split(i), split(i + 1), &out(i))) continue;
        failed(i) = true;
      }
      OP_REQUIRES_OK(context, ReadWholeFile(MountPath(root, name(i)), &out(i)));
    }
  }
};

uint32_t LoadU32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);  // TFRecord is little-endian, as is every host TF runs on
  return v;
}

uint64_t LoadU64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Splits TFRecord framing: [length u64][masked crc32c of length u32][data][masked crc32c u32].
class RecordParser {
 public:
  RecordParser(std::string shard, uint64_t offset) : shard_(std::move(shard)), offset_(offset) {}

  // Where the bytes not taken yet start in the shard.
  uint64_t offset() const { return offset_; }

  // Takes every whole record from the front of `buffer`, leaving the incomplete tail.
  absl::Status Take(std::string* buffer, std::vector<tstring>* records) {
    size_t at = 0;
    while (buffer->size() - at >= kHeader) {
      const char* header = buffer->data() + at;
      const uint64_t length = LoadU64(header);
      if (tsl::crc32c::Unmask(LoadU32(header + 8)) != tsl::crc32c::Value(header, 8)) {
        return Corrupt(offset_ + at, "length");
      }
      if (length > buffer->size() - at - kHeader ||
          buffer->size() - at - kHeader - length < kFooter) {
        break;  // the rest of this record is in the next block
      }
      const char* data = header + kHeader;
      if (tsl::crc32c::Unmask(LoadU32(data + length)) != tsl::crc32c::Value(data, length)) {
        return Corrupt(offset_ + at, "data");
      }
      records->emplace_back(data, length);
      at += kHeader + length + kFooter;
    }
    buffer->erase(0, at);
    offset_ += at;
    return absl::OkStatus();
  }

  // At the end of the shard nothing may be left over.
  absl::Status Finish(const std::string& buffer) const {
    if (!buffer.empty()) {
      return absl::DataLossError("truncated record at " + std::to_string(offset_) + " in " +
                                 shard_);
    }
    return absl::OkStatus();
  }

 private:
  static constexpr size_t kHeader = 12;
  static constexpr size_t kFooter = 4;

  absl::Status Corrupt(uint64_t at, const char* what) const {
    return absl::DataLossError("corrupted record (" + std::string(what) + " checksum) at " +
                               std::to_string(at) + " in " + shard_);
  }

  std::string shard_;
  uint64_t offset_;
};

class ReadTFRecordBlockOp : public OpKernel {
 public:
  explicit ReadTFRecordBlockOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    for (int input = 0; input < context->num_inputs(); ++input) {
      OP_REQUIRES(context, context->input(input).dims() == 0,
                  absl::InvalidArgumentError("every input must be a scalar"));
    }
    const tstring& carry = context->input(0).scalar<tstring>()();
    const int64_t carry_offset = context->input(1).scalar<int64_t>()();
    const std::string file(context->input(2).scalar<tstring>()());
    const int64_t length = context->input(3).scalar<int64_t>()();
    const int64_t checksum = context->input(4).scalar<int64_t>()();
    const bool last = context->input(5).scalar<bool>()();
    const std::string shard(context->input(6).scalar<tstring>()());
    OP_REQUIRES(context, length >= 0 && carry_offset >= 0,
                absl::InvalidArgumentError("a negative block length or carry offset"));

    // The carried bytes, then the block read straight after them.
    std::string buffer(carry.size() + length, '\0');
    std::memcpy(buffer.data(), carry.data(), carry.size());
    char* block = buffer.data() + carry.size();
    const bool ok = ReadExactly(file, block, length) && Verified(block, length, checksum);
    std::vector<tstring> records;
    RecordParser parser(shard, carry_offset);
    if (ok) {
      OP_REQUIRES_OK(context, parser.Take(&buffer, &records));
      if (last) OP_REQUIRES_OK(context, parser.Finish(buffer));
    }

    Tensor* out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(
                                0, TensorShape({static_cast<int64_t>(records.size())}), &out));
    auto flat = out->flat<tstring>();
    for (size_t r = 0; r < records.size(); ++r) flat(r) = std::move(records[r]);
    Tensor* next_carry = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({}), &next_carry));
    next_carry->scalar<tstring>()() = ok ? tstring(buffer) : carry;
    Tensor* next_offset = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(2, TensorShape({}), &next_offset));
    next_offset->scalar<int64_t>()() = ok ? parser.offset() : carry_offset;
    Tensor* ok_out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(3, TensorShape({}), &ok_out));
    ok_out->scalar<bool>()() = ok;
  }
};

absl::Status VectorOfInput(shape_inference::InferenceContext* c, int input,
                           shape_inference::DimensionHandle* dim) {
  shape_inference::ShapeHandle shape;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(input), 1, &shape));
  *dim = c->Dim(shape, 0);
  return absl::OkStatus();
}

}  // namespace

// Stateful: they read files that change underneath (never constant-folded or deduplicated).
REGISTER_OP("CachefsReadFiles")
    .Input("mount_root: string")
    .Input("names: string")
    .Input("local: bool")
    .Input("block_splits: int64")
    .Input("block_files: string")
    .Input("block_lengths: int64")
    .Input("block_checksums: int64")
    .Output("contents: string")
    .Output("fell_back: bool")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::DimensionHandle count;
      TF_RETURN_IF_ERROR(VectorOfInput(c, 1, &count));
      c->set_output(0, c->Vector(count));
      c->set_output(1, c->Vector(count));
      return absl::OkStatus();
    });

REGISTER_OP("CachefsReadTfRecordBlock")
    .Input("carry: string")
    .Input("carry_offset: int64")
    .Input("block_file: string")
    .Input("block_length: int64")
    .Input("block_checksum: int64")
    .Input("last: bool")
    .Input("shard: string")  // its name, for error messages
    .Output("records: string")
    .Output("next_carry: string")
    .Output("next_offset: int64")
    .Output("ok: bool")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      for (int output = 1; output < 4; ++output) c->set_output(output, c->Scalar());
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("CachefsReadFiles").Device(DEVICE_CPU), ReadFilesOp);
REGISTER_KERNEL_BUILDER(Name("CachefsReadTfRecordBlock").Device(DEVICE_CPU),
                        ReadTFRecordBlockOp);
