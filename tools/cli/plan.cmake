# `wsyncctl plan`: included by tools/cli/CMakeLists.txt. The adapter from config.json to planner layouts lives here,
# so the planner library itself stays free of model knowledge.
add_library(wsync_tools_plan ${CMAKE_CURRENT_LIST_DIR}/plan_command.cc)
target_link_libraries(wsync_tools_plan PUBLIC wsync_plan_model wsync_planner wsync_base nlohmann_json::nlohmann_json CLI11::CLI11)

