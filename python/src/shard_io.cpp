// _ductile.shard_io: CRC-32C (Castagnoli) of buffers, and a write of
// buffers into a file (or a copy into a mapping of one) that computes their
// CRC-32C in the same pass.
//
// Why: a zero3 snapshot rewrites every rank's shard after every optimizer
// step. Writing the shard and then checksumming it with zlib reads all of it
// from memory twice; here each block is checksummed right after the write
// read it, while it is still in the cache, and CRC-32C has a CPU instruction
// (SSE4.2) that zlib's CRC-32 lacks.
//
// Ownership: the caller owns the file descriptor (never closed here) and
// the buffers; the buffer views are held (and so the objects kept alive)
// until the call returns.
// Threading: both functions release the GIL while they read the buffers;
// the caller must not resize or free them meanwhile (bytes, numpy arrays
// and memoryviews cannot be resized while a view is exported).
// A large file in shared memory (a snapshot's shard) is written through a
// mapping kept from one call to the next (file_mappings.hpp).
// Errors: a bad argument is InvalidArgumentError naming it; a failed
// write(2) is OSError carrying errno and its strerror.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#include "bindings.hpp"
#include "file_mappings.hpp"

namespace ductile::python {

namespace {

// CRC-32C's polynomial, bit-reflected (the bit order the SSE4.2 instruction
// and iSCSI/ext4/RocksDB use).
constexpr std::uint32_t kCastagnoli = 0x82F63B78u;

using ByteTable = std::array<std::uint32_t, 256>;

// Slicing-by-8: table[k][b] is the CRC state of byte b followed by k zero
// bytes, so that eight bytes cost eight independent look-ups.
constexpr std::array<ByteTable, 8> slicing_tables() {
  std::array<ByteTable, 8> tables{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t state = b;
    for (int bit = 0; bit < 8; ++bit) state = (state >> 1) ^ ((state & 1u) ? kCastagnoli : 0u);
    tables[0][b] = state;
  }
  for (std::size_t k = 1; k < 8; ++k)
    for (std::size_t b = 0; b < 256; ++b)
      tables[k][b] = (tables[k - 1][b] >> 8) ^ tables[0][tables[k - 1][b] & 0xFFu];
  return tables;
}

constexpr std::array<ByteTable, 8> kSlicing = slicing_tables();

std::uint32_t load_le32(const unsigned char* p) {
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
}

// The functions below advance the raw CRC state (no inversion at either
// end); crc32c() below applies CRC-32C's inversions.
std::uint32_t portable_update(std::uint32_t state, const unsigned char* p, std::size_t n) {
  const auto& t = kSlicing;
  for (; n >= 8; p += 8, n -= 8) {
    const std::uint32_t low = state ^ load_le32(p);
    const std::uint32_t high = load_le32(p + 4);
    state = t[7][low & 0xFFu] ^ t[6][(low >> 8) & 0xFFu] ^ t[5][(low >> 16) & 0xFFu] ^
            t[4][low >> 24] ^ t[3][high & 0xFFu] ^ t[2][(high >> 8) & 0xFFu] ^
            t[1][(high >> 16) & 0xFFu] ^ t[0][high >> 24];
  }
  for (; n > 0; ++p, --n) state = t[0][(state ^ *p) & 0xFFu] ^ (state >> 8);
  return state;
}

#if defined(__x86_64__)

// The hardware path runs three independent CRC streams over three adjacent
// stripes: the instruction's latency is three cycles but a new one can start
// every cycle, so one stream alone leaves two thirds of the unit idle. The
// stripes' states are then joined: the state of A followed by B is the state
// of A advanced over |B| zero bytes, XOR the state of B from zero (the CRC
// is linear), and advancing over a fixed number of zero bytes is a linear map
// of the 32-bit state, tabled here per byte of the state.
constexpr std::size_t kLongStripe = 8192;
constexpr std::size_t kShortStripe = 256;

struct ZeroShift {
  std::array<ByteTable, 4> table{};

  explicit ZeroShift(std::size_t zero_bytes) {
    static const std::array<unsigned char, kLongStripe> zeros{};
    std::array<std::uint32_t, 32> of_bit{};
    for (int bit = 0; bit < 32; ++bit)
      of_bit[static_cast<std::size_t>(bit)] =
          portable_update(std::uint32_t{1} << bit, zeros.data(), zero_bytes);
    for (std::size_t k = 0; k < 4; ++k)
      for (std::uint32_t b = 0; b < 256; ++b) {
        std::uint32_t shifted = 0;
        for (std::size_t bit = 0; bit < 8; ++bit)
          if ((b >> bit) & 1u) shifted ^= of_bit[8 * k + bit];
        table[k][b] = shifted;
      }
  }

  std::uint32_t operator()(std::uint32_t state) const {
    return table[0][state & 0xFFu] ^ table[1][(state >> 8) & 0xFFu] ^
           table[2][(state >> 16) & 0xFFu] ^ table[3][state >> 24];
  }
};

const ZeroShift& long_shift() {
  static const ZeroShift shift(kLongStripe);
  return shift;
}

const ZeroShift& short_shift() {
  static const ZeroShift shift(kShortStripe);
  return shift;
}

std::uint64_t load_u64(const unsigned char* p) {
  std::uint64_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

// Three stripes of `stripe` bytes each from p, joined onto `state`.
__attribute__((target("sse4.2"))) std::uint32_t three_stripes(std::uint32_t state,
                                                              const unsigned char* p,
                                                              std::size_t stripe,
                                                              const ZeroShift& shift) {
  std::uint64_t a = state, b = 0, c = 0;
  const unsigned char* q = p + stripe;
  const unsigned char* r = p + 2 * stripe;
  for (std::size_t i = 0; i < stripe; i += 8) {
    a = _mm_crc32_u64(a, load_u64(p + i));
    b = _mm_crc32_u64(b, load_u64(q + i));
    c = _mm_crc32_u64(c, load_u64(r + i));
  }
  std::uint32_t joined = shift(static_cast<std::uint32_t>(a)) ^ static_cast<std::uint32_t>(b);
  return shift(joined) ^ static_cast<std::uint32_t>(c);
}

__attribute__((target("sse4.2"))) std::uint32_t hardware_update(std::uint32_t state,
                                                                const unsigned char* p,
                                                                std::size_t n) {
  for (; n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0; ++p, --n)
    state = _mm_crc32_u8(state, *p);
  if (n >= 3 * kLongStripe) {
    const ZeroShift& shift = long_shift();
    for (; n >= 3 * kLongStripe; p += 3 * kLongStripe, n -= 3 * kLongStripe)
      state = three_stripes(state, p, kLongStripe, shift);
  }
  if (n >= 3 * kShortStripe) {
    const ZeroShift& shift = short_shift();
    for (; n >= 3 * kShortStripe; p += 3 * kShortStripe, n -= 3 * kShortStripe)
      state = three_stripes(state, p, kShortStripe, shift);
  }
  std::uint64_t wide = state;
  for (; n >= 8; p += 8, n -= 8) wide = _mm_crc32_u64(wide, load_u64(p));
  state = static_cast<std::uint32_t>(wide);
  for (; n > 0; ++p, --n) state = _mm_crc32_u8(state, *p);
  return state;
}

bool cpu_has_crc_instruction() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}

#else

bool cpu_has_crc_instruction() {
  return false;
}

std::uint32_t hardware_update(std::uint32_t state, const unsigned char* p, std::size_t n) {
  return portable_update(state, p, n);
}

#endif

std::uint32_t update(std::uint32_t state, const unsigned char* p, std::size_t n) {
  return cpu_has_crc_instruction() ? hardware_update(state, p, n) : portable_update(state, p, n);
}

std::string shown(const py::handle& value) {
  std::string text = py::repr(value).cast<std::string>();
  if (text.size() > 80) text = text.substr(0, 80) + "...";
  return text;
}

// Read-only views of Python buffers, released (with the GIL held) when this
// goes away.
class BufferViews {
 public:
  BufferViews() = default;
  BufferViews(const BufferViews&) = delete;
  BufferViews& operator=(const BufferViews&) = delete;
  ~BufferViews() {
    for (auto& view : views_) PyBuffer_Release(&view);
  }

  // A contiguous view of `object`, or InvalidArgumentError naming `name`.
  const Py_buffer& add(const py::handle& object, const std::string& name) {
    // Room first: a push_back that threw would leak the view.
    if (views_.size() == views_.capacity()) views_.reserve(2 * views_.size() + 8);
    Py_buffer view{};
    if (PyObject_GetBuffer(object.ptr(), &view, PyBUF_SIMPLE) != 0) {
      PyErr_Clear();
      throw Error(ErrorKind::invalid_argument,
                  name + " = " + shown(object) + " is not a contiguous buffer (" +
                      py::str(py::type::of(object).attr("__name__")).cast<std::string>() +
                      "); give bytes, a bytearray, a memoryview or a C-contiguous array");
    }
    views_.push_back(view);
    return views_.back();
  }

  const std::vector<Py_buffer>& views() const { return views_; }

 private:
  std::vector<Py_buffer> views_;
};

std::uint32_t crc_argument(const py::handle& value) {
  return static_cast<std::uint32_t>(int_argument(value, "value", 0, 0xFFFFFFFFLL));
}

// Below this many bytes the GIL round trip costs more than it frees.
constexpr std::size_t kReleaseGilBytes = 64 * 1024;

template <typename Update>
std::uint32_t crc_of(const py::handle& buffer, const py::handle& value, Update update_state) {
  BufferViews views;
  const Py_buffer& view = views.add(buffer, "buffer");
  const auto* data = static_cast<const unsigned char*>(view.buf);
  const auto size = static_cast<std::size_t>(view.len);
  std::uint32_t state = ~crc_argument(value);
  if (size < kReleaseGilBytes) return ~update_state(state, data, size);
  py::gil_scoped_release released;
  return ~update_state(state, data, size);
}

// Each block is written, then checksummed while the write has left it in
// the cache; a few hundred KiB fit a core's L2 with room to spare.
constexpr std::size_t kWriteBlock = 256 * 1024;

// Copies src[0, n) to dst with stores that bypass the cache: a snapshot's
// bytes are not read again by this process, and ordinary stores would both
// evict the step's working set and read every destination line first
// (40 % slower for a shard's 256 KiB blocks).
void copy_around_cache(unsigned char* dst, const unsigned char* src, std::size_t n) {
#if defined(__x86_64__)
  const std::size_t head = std::min(n, (16 - reinterpret_cast<std::uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  std::size_t i = head;
  for (; i + 64 <= n; i += 64)
    for (std::size_t lane = 0; lane < 64; lane += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + lane),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + lane)));
  _mm_sfence();  // the streamed stores are ordered before whatever follows
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

// Adds a view of each of `buffers` (an iterable of bytes-like objects) to
// `views`; their total size. InvalidArgumentError naming the argument, or
// the item, that is not one.
std::uint64_t add_buffers(BufferViews& views, const py::handle& buffers) {
  if (PyObject_CheckBuffer(buffers.ptr()) || !py::isinstance<py::iterable>(buffers))
    throw Error(ErrorKind::invalid_argument,
                "buffers = " + shown(buffers) +
                    " is not a list of buffers; give a list (or any iterable) of bytes-like "
                    "objects, e.g. [data] for one");
  std::size_t index = 0;
  std::uint64_t total = 0;
  for (const auto& item : buffers) {
    const Py_buffer& view = views.add(item, "buffers[" + std::to_string(index++) + "]");
    total += static_cast<std::uint64_t>(view.len);
  }
  return total;
}

// Writes p[0, n) at `offset` of `fd`, resuming after partial writes and
// EINTR; 0 or the errno of the failure.
int write_all(int fd, const unsigned char* p, std::size_t n, off_t offset) {
  while (n > 0) {
    const ssize_t written = pwrite(fd, p, n, offset);
    if (written < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    // write(2) of a regular file returns 0 only for n == 0; anything else
    // would loop forever.
    if (written == 0) return EIO;
    p += written;
    n -= static_cast<std::size_t>(written);
    offset += written;
  }
  return 0;
}

py::tuple write_buffers(const py::handle& fd_argument, const py::handle& buffers,
                        const py::handle& offset_argument, const py::handle& value) {
  const int fd = static_cast<int>(int_argument(fd_argument, "fd", 0, INT_MAX));
  const std::int64_t offset = int_argument(offset_argument, "offset", 0, LLONG_MAX);
  std::uint32_t state = ~crc_argument(value);
  BufferViews views;
  const std::uint64_t total = add_buffers(views, buffers);
  if (total > static_cast<std::uint64_t>(LLONG_MAX - offset))
    throw Error(ErrorKind::invalid_argument,
                "offset = " + std::to_string(offset) + " plus the " + std::to_string(total) +
                    " bytes of the buffers is past the largest file offset " +
                    std::to_string(LLONG_MAX));
  int error = 0;
  {
    py::gil_scoped_release released;
    const auto mapped =
        FileMappings::instance().lease(fd, static_cast<std::uint64_t>(offset) + total);
    auto position = static_cast<off_t>(offset);
    for (const auto& view : views.views()) {
      const auto* p = static_cast<const unsigned char*>(view.buf);
      auto left = static_cast<std::size_t>(view.len);
      while (left > 0 && error == 0) {
        const std::size_t block = left < kWriteBlock ? left : kWriteBlock;
        if (mapped)
          copy_around_cache(mapped.data() + position, p, block);
        else
          error = write_all(fd, p, block, position);
        if (error != 0) break;
        state = update(state, p, block);
        p += block;
        left -= block;
        position += static_cast<off_t>(block);
      }
      if (error != 0) break;
    }
  }
  if (error != 0) {
    errno = error;
    PyErr_SetFromErrno(PyExc_OSError);
    throw py::error_already_set();
  }
  return py::make_tuple(total, ~state);
}

// Copies the buffers one after another into the writable buffer `target`
// from byte `offset` on, with the same stores and fused checksum as
// write_buffers: a snapshot's file mapped by the caller (kept from one
// snapshot to the next) is filled without a write(2) or a second pass.
py::tuple copy_buffers(const py::handle& target, const py::handle& offset_argument,
                       const py::handle& buffers, const py::handle& value) {
  const std::int64_t offset = int_argument(offset_argument, "offset", 0, LLONG_MAX);
  std::uint32_t state = ~crc_argument(value);
  BufferViews views;
  const std::uint64_t total = add_buffers(views, buffers);
  Py_buffer into{};
  if (PyObject_GetBuffer(target.ptr(), &into, PyBUF_WRITABLE) != 0) {
    PyErr_Clear();
    throw Error(ErrorKind::invalid_argument,
                "target = " + shown(target) +
                    " is not a writable contiguous buffer; give a bytearray, a writable "
                    "memoryview or mmap, or a C-contiguous writable array");
  }
  // Released when this returns, after the GIL is taken back.
  const std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> held(&into, PyBuffer_Release);
  const auto room = static_cast<std::uint64_t>(into.len);
  if (static_cast<std::uint64_t>(offset) > room ||
      total > room - static_cast<std::uint64_t>(offset))
    throw Error(ErrorKind::invalid_argument, "offset = " + std::to_string(offset) + " plus the " +
                                                 std::to_string(total) +
                                                 " bytes of the buffers is past the target's " +
                                                 std::to_string(room) + " bytes");
  {
    py::gil_scoped_release released;
    unsigned char* position = static_cast<unsigned char*>(into.buf) + offset;
    for (const auto& view : views.views()) {
      const auto* p = static_cast<const unsigned char*>(view.buf);
      auto left = static_cast<std::size_t>(view.len);
      while (left > 0) {
        const std::size_t block = left < kWriteBlock ? left : kWriteBlock;
        copy_around_cache(position, p, block);
        state = update(state, p, block);
        p += block;
        left -= block;
        position += block;
      }
    }
  }
  return py::make_tuple(total, ~state);
}

}  // namespace

void register_shard_io(py::module_& m) {
  m.def(
      "crc32c",
      [](const py::object& buffer, const py::object& value) {
        return crc_of(buffer, value, update);
      },
      py::arg("buffer"), py::arg("value") = 0,
      "crc32c(buffer, value=0) -> int\n\n"
      "The CRC-32C (Castagnoli) of a contiguous bytes-like object (read-only is fine), "
      "continuing from `value`, the CRC-32C of the bytes before it (as zlib.crc32 continues): "
      "crc32c(b, crc32c(a)) == crc32c(a + b). Uses the CPU's SSE4.2 instruction where there "
      "is one, a table otherwise; both give the same value.\n"
      "Ownership: the buffer stays the caller's; it is read, never kept.\n"
      "Threading: the GIL is released while a large buffer is read.\n"
      "Errors: InvalidArgumentError for a buffer that is not contiguous bytes-like, or a "
      "value outside 0..2**32-1.");
  m.def(
      "crc32c_portable",
      [](const py::object& buffer, const py::object& value) {
        return crc_of(buffer, value, portable_update);
      },
      py::arg("buffer"), py::arg("value") = 0,
      "crc32c() computed by the table, never by the CPU instruction: the same value, "
      "slower; there so that the two can be compared.");
  m.def("crc32c_uses_cpu_instruction", &cpu_has_crc_instruction,
        "Whether crc32c() runs on the CPU's CRC-32C instruction (SSE4.2).");
  m.def("write_buffers", &write_buffers, py::arg("fd"), py::arg("buffers"), py::arg("offset") = 0,
        py::arg("value") = 0,
        "write_buffers(fd, buffers, offset=0, value=0) -> (bytes_written, crc32c)\n\n"
        "Writes the bytes-like objects of `buffers` one after another into the open file `fd`, "
        "from byte `offset` on (pwrite: the descriptor's own position is left alone), and "
        "returns how many bytes it wrote and their CRC-32C, continuing from `value` (see "
        "crc32c). Each block is checksummed right after it is written, while it is still in "
        "the cache. A file longer than what is written keeps its tail: truncate it after.\n"
        "Ownership: the caller owns fd and closes it; the buffers are held until the call "
        "returns.\n"
        "Threading: the GIL is released while writing; do not resize the buffers meanwhile.\n"
        "Errors: OSError with errno and its strerror when a write fails (ENOSPC, EIO, EBADF, "
        "...), after which the file holds a prefix of the data; InvalidArgumentError naming "
        "fd, offset, value or buffers[i] when one is not valid.");
  m.def("copy_buffers", &copy_buffers, py::arg("target"), py::arg("offset"), py::arg("buffers"),
        py::arg("value") = 0,
        "copy_buffers(target, offset, buffers, value=0) -> (bytes_copied, crc32c)\n\n"
        "Copies the bytes-like objects of `buffers` one after another into the writable "
        "buffer `target` (a file's mapping, say), from byte `offset` on, and returns how many "
        "bytes it copied and their CRC-32C, continuing from `value` (see crc32c). As in "
        "write_buffers, the stores bypass the cache and each block is checksummed while it "
        "is still in the cache.\n"
        "Ownership: target and buffers stay the caller's; they are held until the call "
        "returns.\n"
        "Threading: the GIL is released while copying; do not resize the buffers "
        "meanwhile.\n"
        "Errors: InvalidArgumentError naming target, offset, value or buffers[i] when one is "
        "not valid, or when the buffers do not fit in target from offset.");
}

}  // namespace ductile::python
