# `wsyncctl plan`: included by tools/CMakeLists.txt. The adapter from config.json to planner layouts lives here,
# so the planner library itself stays free of model knowledge.
add_library(wsync_tools_plan ${CMAKE_CURRENT_LIST_DIR}/plan_command.cc)
target_link_libraries(wsync_tools_plan PUBLIC wsync_planner wsync_base nlohmann_json::nlohmann_json CLI11::CLI11)

# Standalone `wsyncctl-plan` (same flags as `wsyncctl plan`) until the command is wired into wsyncctl.
set(_wsync_plan_main ${CMAKE_CURRENT_BINARY_DIR}/wsyncctl_plan_main.cc)
file(WRITE ${_wsync_plan_main}.in [=[
#include <vector>
#include "tools/plan_command.h"
int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  static char plan[] = "plan";
  args[0] = plan;
  return wsync::tools::RunPlanCommand(static_cast<int>(args.size()), args.data());
}
]=])
configure_file(${_wsync_plan_main}.in ${_wsync_plan_main} COPYONLY)
add_executable(wsyncctl-plan ${_wsync_plan_main})
target_link_libraries(wsyncctl-plan PRIVATE wsync_tools_plan)
