/* A library the dynamic loader must never take: cli_test puts copies of it in
 * the current directory under the names of the libraries the CLI and its
 * plugins need. Were one of them loaded (an empty entry in a run path is the
 * current directory), its constructor would leave a file behind. */
#include <fcntl.h>
#include <unistd.h>

__attribute__((constructor)) static void planted_library_loaded(void) {
  int fd = open("planted-library-was-loaded", O_CREAT | O_WRONLY, 0644);
  if (fd >= 0) close(fd);
}
