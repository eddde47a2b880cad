// Compile check of the device code without torch (make test: nvcc -arch=sm_90 -c, seconds).
// Taking each launcher's address makes nvcc emit it and every kernel it instantiates.
#include "records.cuh"
#include "rows.cuh"
#include "segment_sum.cuh"

namespace railwave::kernels {
extern void* const kAllLaunchers[];
void* const kAllLaunchers[] = {
    reinterpret_cast<void*>(&launch_records_from_routing), reinterpret_cast<void*>(&records_workspace_bytes),
    reinterpret_cast<void*>(&launch_assign_egress),        reinterpret_cast<void*>(&launch_records_per_node_rail),
    reinterpret_cast<void*>(&launch_copy_rows),            reinterpret_cast<void*>(&launch_segment_sum),
    reinterpret_cast<void*>(&segment_sum_workspace_bytes),
};
}  // namespace railwave::kernels
