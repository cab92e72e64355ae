// Compiles against the format layer's include folder: headers of its own layer and below.
#include "ckptfs/source.hpp"
#include "format/torch_archive.hpp"
#include "io/checked_math.hpp"
