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
