# The rdma-core verbs backend. Included by transport/CMakeLists.txt when WSYNC_WITH_VERBS is ON.
# libibverbs is not linked: ibv_api.cc loads it at run time (dlopen), so binaries start on hosts without rdma-core
# and the verbs transport reports itself not viable there. Only its headers are needed to build.
target_sources(wsync_transport PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/ibv_api.cc
  ${CMAKE_CURRENT_LIST_DIR}/verbs_device.cc
  ${CMAKE_CURRENT_LIST_DIR}/verbs_endpoint.cc
  ${CMAKE_CURRENT_LIST_DIR}/verbs_handles.cc
  ${CMAKE_CURRENT_LIST_DIR}/verbs_transport.cc
  ${CMAKE_CURRENT_LIST_DIR}/verbs_wire.cc
)
target_include_directories(wsync_transport PRIVATE ${IBVERBS_INCLUDE_DIRS})
target_link_libraries(wsync_transport PRIVATE ${CMAKE_DL_LIBS})
target_compile_definitions(wsync_transport PRIVATE WSYNC_WITH_VERBS=1)
