# bench_transport_verbs, included by bench/transport/CMakeLists.txt. Run it with run_verbs_bench.sh, which measures
# the ib_write_bw baseline on the same device in the same run (inside the soft-RoCE VM when the host has no RDMA).
if(NOT TARGET wsync_transport OR NOT WSYNC_WITH_VERBS)
  return()
endif()
add_executable(bench_transport_verbs
  ${CMAKE_CURRENT_LIST_DIR}/verbs_bench_main.cc ${CMAKE_CURRENT_LIST_DIR}/verbs_bench.cc)
target_link_libraries(bench_transport_verbs PRIVATE wsync_transport wsync_base absl::strings absl::str_format)

# bench_verbs_window: the cost of a verbs target's write window next to the alternatives (reconnecting QPs,
# re-registering MRs), measured in the same run. Run it inside the soft-RoCE VM when the host has no RDMA device.
add_executable(bench_verbs_window ${CMAKE_CURRENT_LIST_DIR}/verbs_window_bench.cc)
target_link_libraries(bench_verbs_window PRIVATE wsync_transport wsync_base absl::strings)

# bench_verbs_grants: what per-connection write grants cost (connection setup, window toggle, writes) next to plain
# connections, measured in the same run. Run it inside the soft-RoCE VM when the host has no RDMA device.
add_executable(bench_verbs_grants ${CMAKE_CURRENT_LIST_DIR}/verbs_grants_bench.cc)
target_link_libraries(bench_verbs_grants PRIVATE wsync_transport wsync_base absl::strings)
