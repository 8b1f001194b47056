# The libfabric backend. Included by transport/CMakeLists.txt when WSYNC_WITH_FABRIC is ON.
# libfabric is not linked: fi_api.cc loads it at run time (dlopen), so binaries start on hosts without it and the
# fabric transport reports itself not viable there. Only its headers are needed to build.
target_sources(wsync_transport PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/fi_api.cc
  ${CMAKE_CURRENT_LIST_DIR}/fabric_domains.cc
  ${CMAKE_CURRENT_LIST_DIR}/fabric_endpoint.cc
  ${CMAKE_CURRENT_LIST_DIR}/fabric_hmem.cc
  ${CMAKE_CURRENT_LIST_DIR}/fabric_progress.cc
  ${CMAKE_CURRENT_LIST_DIR}/fabric_transport.cc
  ${CMAKE_CURRENT_LIST_DIR}/fabric_wire.cc
)
target_include_directories(wsync_transport PRIVATE ${FABRIC_INCLUDE_DIR})
target_link_libraries(wsync_transport PRIVATE ${CMAKE_DL_LIBS})
target_compile_definitions(wsync_transport PRIVATE WSYNC_WITH_FABRIC=1)
