# Verbs transport tests, included by tests/transport/CMakeLists.txt.
#   transport_verbs_unit_test  blob formats and the no-device path; runs anywhere.
#   transport_verbs_test       the conformance suite + verbs cases on a real RDMA device; exits 77 without one.
#   transport_verbs_vm_test    runs transport_verbs_test inside the soft-RoCE VM (one boot for every case).
if(NOT TARGET wsync_transport OR NOT WSYNC_WITH_VERBS)
  return()
endif()

wsync_add_test(transport_verbs_unit_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/verbs_unit_test.cc
  LIBS wsync_transport
  LABELS transport asan
  TIMEOUT 60)

wsync_add_test(transport_verbs_wire_fuzz_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/verbs_wire_fuzz_test.cc
  LIBS wsync_transport
  LABELS fuzz asan
  TIMEOUT 120)

# Needs an RDMA device on the host itself (none in this kernel): it skips here, and transport_verbs_vm_test runs
# the same executable inside the soft-RoCE VM. Label rdma_device: the only skip besides cuda that CI accepts.
wsync_add_test(transport_verbs_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/conformance_test.cc ${CMAKE_CURRENT_LIST_DIR}/verbs_factory.cc
          ${CMAKE_CURRENT_LIST_DIR}/verbs_test.cc ${CMAKE_CURRENT_LIST_DIR}/verbs_window_test.cc
  LIBS wsync_transport absl::random_random
  LABELS rdma rdma_device
  TIMEOUT 300)

# CI checks out shared/ beside the repository; the harness boots a soft-RoCE guest that sees this filesystem.
set(WSYNC_RXE_VM_SCRIPT "${PROJECT_SOURCE_DIR}/../shared/tools/rxe-vm/run-in-rxe-vm.sh"
    CACHE FILEPATH "soft-RoCE VM harness used by transport_verbs_vm_test")
add_test(NAME transport_verbs_vm_test
  COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_in_rxe_vm.sh ${WSYNC_RXE_VM_SCRIPT}
          $<TARGET_FILE:transport_verbs_test> --durations yes)
set_tests_properties(transport_verbs_vm_test PROPERTIES
  LABELS rdma
  SKIP_RETURN_CODE 77
  TIMEOUT 240
  COST 45  # its seconds in CI (tests/README.md, "Order")
  ENVIRONMENT "RXE_VM_TIMEOUT=200;RXE_VM_MEM=2048M")
