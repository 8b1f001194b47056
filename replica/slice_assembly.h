#pragma once
// Assembling a tensor pushed in slices (base/tensor_slice.h) and the model rules of the push order: pure geometry on
// the replica's reads and placements of a tensor, with no state and no locks. The source daemon keeps, per tensor of
// an update, which slices were claimed and landed; these functions decide what a slice may be and where its bytes go.

#include <cstddef>
#include <cstdint>

#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/tensor_slice.h"
#include "replica/replica.h"

namespace wsync::replica {

// Whether two slices of one tensor share an element (their rectangles of the 2-D view intersect).
bool SlicesOverlap(const TensorSlice& a, const TensorSlice& b);

// Whether disjoint `landed` slices cover every rectangle a read of `need` takes from the tensor: the tensor is then
// complete for this node, though parts no read takes may never arrive.
bool SlicesCover(absl::Span<const TensorRead> need, absl::Span<const TensorSlice> landed);

// Copies a slice's bytes (`data`: its rows × cols elements of `elem_size` bytes, row-major) where `rects` place the
// whole tensor's (Replica::PlaceRects), only the parts of each rectangle the slice holds. `buffer(layout)` is the
// layout buffer a rectangle's offset is in. Slices that do not overlap write disjoint bytes: they may land at once.
void LandSlice(const TensorSlice& s, size_t elem_size, absl::Span<const PlacedRect> rects, const uint8_t* data,
               absl::FunctionRef<uint8_t*(int layout)> buffer);

// Copies a slice's bytes into `whole`, the tensor's full_rows × full_cols elements row-major (a tensor the replica
// must convert whole is staged this way until its last slice).
void StageSlice(const TensorSlice& s, size_t elem_size, const uint8_t* data, uint8_t* whole);

// Tensors of routed experts (".experts."): pushed after the others, so that a node's first buckets complete whole
// dense layers.
bool IsExpertTensor(absl::string_view name);

// The block scales of a weight pushed already quantized ("<weight>_scale_inv", beside its float8_e4m3fn codes): a
// second frame of that weight, not a tensor of its own.
bool IsScaleFrame(absl::string_view name);

}  // namespace wsync::replica
