// Little-endian byte codec for the wire formats (addresses, descriptors). Bounds-checked: a
// Reader never reads past its input and reports the first field that did not fit.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace fabric::detail {

class ByteWriter {
 public:
  void u8(uint8_t v) { out_.push_back(static_cast<std::byte>(v)); }
  void u16(uint16_t v) { put(v); }
  void u32(uint32_t v) { put(v); }
  void u64(uint64_t v) { put(v); }
  void bytes(std::span<const std::byte> b) { out_.insert(out_.end(), b.begin(), b.end()); }
  std::vector<std::byte> take() { return std::move(out_); }

 private:
  template <typename T>
  void put(T v) {
    static_assert(std::endian::native == std::endian::little, "wire format is little-endian");
    const size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &v, sizeof(T));
  }
  std::vector<std::byte> out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::span<const std::byte> in) : in_(in) {}

  // Each returns false, and leaves the output untouched, when fewer bytes remain than needed.
  bool u8(uint8_t& v) { return get(v); }
  bool u16(uint16_t& v) { return get(v); }
  bool u32(uint32_t& v) { return get(v); }
  bool u64(uint64_t& v) { return get(v); }
  bool bytes(size_t n, std::vector<std::byte>& v) {
    if (in_.size() - pos_ < n) return false;
    v.assign(in_.begin() + static_cast<std::ptrdiff_t>(pos_),
             in_.begin() + static_cast<std::ptrdiff_t>(pos_ + n));
    pos_ += n;
    return true;
  }
  size_t remaining() const { return in_.size() - pos_; }

 private:
  template <typename T>
  bool get(T& v) {
    if (in_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  std::span<const std::byte> in_;
  size_t pos_ = 0;
};

}  // namespace fabric::detail
