# ductile_add_plugin(NAME <name> KIND <kind> SOURCES <src>... [LIBRARIES <lib>...]
#                    [SHARED_RUNTIME])
#
# Builds libductile_<kind>_<name>.so, a ductile plugin: hidden visibility,
# only the `ductile_plugin_entry` symbol exported, linked against the SDK.
# In the ductile source tree with DUCTILE_STATIC_RUNTIME, the plugin carries
# fmt, spdlog and the C++ runtime itself (sdk/static_runtime), unless
# SHARED_RUNTIME is given: a plugin that shares C++ objects with a shared
# library of its own (the accelerators' common library) links the shared
# runtime as that library does.
# KIND is one of elasticity, batching, lr, accelerator, zero, optimizer. The CMake target
# is ductile_<kind>_<name> with characters other than [A-Za-z0-9_] replaced
# by '_' (so NAME v0.1 gives the target ductile_elasticity_v0_1); the
# variable DUCTILE_LAST_PLUGIN_TARGET holds it after the call.
#
# In the ductile source tree the plugin goes to the built-in plugin directory
# and is installed; out of tree (after find_package(ductile)) it lands in the
# current binary directory, or in DUCTILE_PLUGIN_OUTPUT_DIR when set.
set(_DUCTILE_PLUGIN_CMAKE_DIR ${CMAKE_CURRENT_LIST_DIR} CACHE INTERNAL "Where DuctilePlugin.cmake lives")

function(ductile_add_plugin)
  cmake_parse_arguments(ARG "SHARED_RUNTIME" "NAME;KIND" "SOURCES;LIBRARIES" ${ARGN})
  if(NOT ARG_NAME OR NOT ARG_KIND OR NOT ARG_SOURCES)
    message(FATAL_ERROR "ductile_add_plugin: NAME, KIND and SOURCES are required")
  endif()
  set(_kinds elasticity batching lr accelerator zero optimizer)
  if(NOT ARG_KIND IN_LIST _kinds)
    message(FATAL_ERROR "ductile_add_plugin: KIND '${ARG_KIND}' is not one of: ${_kinds}")
  endif()
  if(NOT ARG_NAME MATCHES "^[A-Za-z0-9_.-]+$")
    message(FATAL_ERROR "ductile_add_plugin: NAME '${ARG_NAME}' may only use [A-Za-z0-9_.-]")
  endif()
  string(MAKE_C_IDENTIFIER "ductile_${ARG_KIND}_${ARG_NAME}" _target)
  add_library(${_target} MODULE ${ARG_SOURCES})
  set_target_properties(${_target} PROPERTIES
    PREFIX "lib"
    OUTPUT_NAME "ductile_${ARG_KIND}_${ARG_NAME}"
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    CXX_STANDARD 20
    CXX_STANDARD_REQUIRED ON)
  # In the ductile tree a plugin needs no run path: what it links is the
  # system's (or the accelerators' common library, which sets its own).
  # Front ends that need every built-in plugin built (the Python package)
  # find them here rather than in a list of names.
  if(PROJECT_NAME STREQUAL "ductile")
    set_target_properties(${_target} PROPERTIES INSTALL_RPATH "")
    set_property(GLOBAL APPEND PROPERTY DUCTILE_BUILTIN_PLUGIN_TARGETS ${_target})
  endif()
  if(DUCTILE_PLUGIN_OUTPUT_DIR)
    set_target_properties(${_target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${DUCTILE_PLUGIN_OUTPUT_DIR})
  endif()
  if(DUCTILE_STATIC_RUNTIME AND COMMAND ductile_link_static_runtime AND NOT ARG_SHARED_RUNTIME)
    ductile_link_static_runtime(${_target} PLUGIN)
  endif()
  target_link_libraries(${_target} PRIVATE ductile::sdk ${ARG_LIBRARIES})
  target_link_options(${_target} PRIVATE
    "LINKER:--version-script=${_DUCTILE_PLUGIN_CMAKE_DIR}/plugin_exports.map"
    "LINKER:--no-undefined")
  if(DEFINED DUCTILE_PLUGIN_INSTALL_DIR)
    install(TARGETS ${_target} LIBRARY DESTINATION ${DUCTILE_PLUGIN_INSTALL_DIR})
  endif()
  set(DUCTILE_LAST_PLUGIN_TARGET ${_target} PARENT_SCOPE)
endfunction()
