# The rdma-core verbs backend. Included by transport/CMakeLists.txt when WSYNC_WITH_VERBS is ON.
target_sources(wsync_transport PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/verbs_device.cc
  ${CMAKE_CURRENT_LIST_DIR}/verbs_endpoint.cc
  ${CMAKE_CURRENT_LIST_DIR}/verbs_handles.cc
  ${CMAKE_CURRENT_LIST_DIR}/verbs_transport.cc
  ${CMAKE_CURRENT_LIST_DIR}/verbs_wire.cc
)
# Public: tests and benchmarks include verbs_transport.h, which needs nothing from rdma-core, but the static
# library's consumers must link libibverbs.
target_link_libraries(wsync_transport PUBLIC PkgConfig::IBVERBS)
target_compile_definitions(wsync_transport PRIVATE WSYNC_WITH_VERBS=1)
