# Golden tests: the replica's bytes against the independent numpy oracle (golden_oracle.py). Included from
# tests/replica/CMakeLists.txt. The binary has its own main so it can exit 77 (skipped) when no python3 with numpy
# exists; configure-time detection only supplies a preferred interpreter.
find_program(WSYNC_GOLDEN_PYTHON_EXE NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(NOT WSYNC_GOLDEN_PYTHON_EXE)
  find_program(WSYNC_GOLDEN_PYTHON_EXE NAMES python3)
endif()

add_executable(replica_golden_test golden_test.cc)
target_link_libraries(replica_golden_test PRIVATE Catch2::Catch2 wsync_replica nlohmann_json::nlohmann_json)
target_compile_definitions(replica_golden_test PRIVATE
  WSYNC_MODELS_DIR="${PROJECT_SOURCE_DIR}/tests/data/models"
  WSYNC_GOLDEN_ORACLE="${CMAKE_CURRENT_SOURCE_DIR}/golden_oracle.py")
if(WSYNC_GOLDEN_PYTHON_EXE)
  target_compile_definitions(replica_golden_test PRIVATE WSYNC_GOLDEN_PYTHON="${WSYNC_GOLDEN_PYTHON_EXE}")
endif()
add_test(NAME replica_golden_test COMMAND replica_golden_test)
set_tests_properties(replica_golden_test PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 LABELS "golden")

# The same golden cases with SGLang 0.5.23 itself as the oracle (sglang_oracle.py builds SGLang's model classes on the
# CPU and runs their own weight loaders). sglang_venv.sh creates the pinned venv when missing and runs the binary in it.
# One oracle process serves every case (sglang_oracle.py --serve: torch and SGLang imported once, a forked child per
# job): ~45 s instead of ~9.5 min on the shared 2-core machine.
add_executable(replica_sglang_oracle_test golden_test.cc)
target_link_libraries(replica_sglang_oracle_test PRIVATE Catch2::Catch2 wsync_replica nlohmann_json::nlohmann_json)
target_compile_definitions(replica_sglang_oracle_test PRIVATE
  WSYNC_SGLANG_ORACLE=1
  WSYNC_MODELS_DIR="${PROJECT_SOURCE_DIR}/tests/data/models"
  WSYNC_GOLDEN_ORACLE="${CMAKE_CURRENT_SOURCE_DIR}/sglang_oracle.py")
add_test(NAME replica_sglang_oracle_test
  COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/sglang_venv.sh $<TARGET_FILE:replica_sglang_oracle_test>)
# COST: its seconds in CI (tests/README.md, "Order").
set_tests_properties(replica_sglang_oracle_test PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77 LABELS "sglang" COST 46)
