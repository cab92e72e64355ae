// The format layer may not see the view above it: compiling this against the format
// layer's include folder must fail.
#include "ckptfs/source.hpp"
#include "ckptfs/view.hpp"
