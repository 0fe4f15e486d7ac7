// C++ tests of the disk I/O engine, run by ctest without Python (see CMakeLists.txt): bytes land at their
// offset whatever the alignment of memory, offset and length; errors come back with their errno; a request
// submitted to a closed engine fails instead of waiting forever.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "io/engine.h"
#include "tests/check.h"

namespace zio = zero_kernels::io;

namespace {

using zero_kernels::testing::expect;

std::vector<char> read_back(const std::string& path, int64_t offset, int64_t nbytes) {
  std::vector<char> out(nbytes);
  const int fd = ::open(path.c_str(), O_RDONLY);
  const ssize_t n = fd >= 0 ? ::pread(fd, out.data(), nbytes, offset) : -1;
  if (fd >= 0) ::close(fd);
  if (n != nbytes) out.clear();
  return out;
}

void round_trips(const std::string& dir) {
  zio::Engine engine(zio::Options{8192, 4, 2, true});
  std::vector<char> memory(200000 + 2 * zio::kPage);
  for (size_t i = 0; i < memory.size(); ++i) memory[i] = static_cast<char>(i * 131 + 7);
  for (int64_t nbytes : {int64_t{1}, int64_t{8191}, int64_t{8193}, int64_t{100003}}) {
    for (int64_t offset : {int64_t{0}, int64_t{5}, zio::kPage, 3 * zio::kPage + 1}) {
      for (int64_t shift : {int64_t{0}, int64_t{1}}) {
        const std::string path = dir + "/f";
        const std::string name = "n=" + std::to_string(nbytes) + " offset=" + std::to_string(offset) +
                                 " shift=" + std::to_string(shift);
        char* data = memory.data() + shift;
        auto written = engine.submit(path, data, nbytes, offset, true, nullptr)->wait();
        expect(written.error == 0, name + ": write failed: " + written.detail);
        expect(read_back(path, offset, nbytes) == std::vector<char>(data, data + nbytes), name + ": file bytes");
        std::vector<char> back(nbytes + 1, 0);
        auto read = engine.submit(path, back.data() + shift, nbytes, offset, false, nullptr)->wait();
        expect(read.error == 0, name + ": read failed: " + read.detail);
        expect(std::memcmp(back.data() + shift, data, nbytes) == 0, name + ": read back");
        ::unlink(path.c_str());
      }
    }
  }
}

void errors(const std::string& dir) {
  zio::Engine engine(zio::Options{});
  char byte = 0;
  auto missing = engine.submit(dir + "/missing/f", &byte, 1, 0, true, nullptr)->wait();
  expect(missing.error == ENOENT, "a missing directory gives ENOENT, got " + std::to_string(missing.error));
  auto request = engine.submit(dir + "/short", &byte, 1, 0, true, nullptr);
  expect(request->wait().error == 0, "a one-byte write");
  std::vector<char> two(2);
  auto past = engine.submit(dir + "/short", two.data(), 2, 0, false, nullptr)->wait();
  expect(past.error == ENODATA && past.detail.find("ends at byte 1") != std::string::npos,
         "a read past the end gives ENODATA and where the file ends: " + past.detail);
  engine.close();
  auto closed = engine.submit(dir + "/short", &byte, 1, 0, true, nullptr);
  expect(closed->done() && closed->wait().error == EBADF, "a request to a closed engine fails at once");
}

}  // namespace

int main() {
  char pattern[] = "/var/tmp/zk_test_io_XXXXXX";
  const char* dir = ::mkdtemp(pattern);
  if (dir == nullptr) {
    std::printf("FAIL: mkdtemp\n");
    return 1;
  }
  round_trips(dir);
  errors(dir);
  for (const char* name : {"/short", "/f"}) ::unlink((std::string(dir) + name).c_str());
  ::rmdir(dir);
  return zero_kernels::testing::finish("disk I/O engine tests");
}
