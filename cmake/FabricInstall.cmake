# cmake --install: the public headers, the static libraries, the CMake package `fabric`
# (find_package(fabric CONFIG) gives fabric::fabric, fabric::kv, fabric::kv_etcd,
# fabric::weights, fabric::ep and, in CUDA builds, fabric::cuda) and fabric.pc / fabric-kv.pc /
# fabric-ep.pc for pkg-config. tests/consumer builds against an installed copy both ways (ctest -L consumer).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(FABRIC_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/fabric)
set(FABRIC_INSTALL_TARGETS fabric_lib fabric_kv fabric_kv_etcd fabric_weights fabric_ep)
if(FABRIC_CUDA_ENABLED)
  # The CUDA parts (UvmWatcher, GPU memory) live in fabric::fabric; fabric::cuda adds the
  # device-side header's needs (the CUDA runtime) for code that launches watcher stores.
  add_library(fabric_cuda INTERFACE)
  set_target_properties(fabric_cuda PROPERTIES EXPORT_NAME cuda)
  target_link_libraries(fabric_cuda INTERFACE fabric_lib CUDA::cudart_static)
  add_library(fabric::cuda ALIAS fabric_cuda)
  list(APPEND FABRIC_INSTALL_TARGETS fabric_cuda)
endif()

install(TARGETS ${FABRIC_INSTALL_TARGETS} EXPORT fabricTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/fabric DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT fabricTargets NAMESPACE fabric:: DESTINATION ${FABRIC_CMAKE_DIR})

configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/fabricConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/fabricConfig.cmake INSTALL_DESTINATION ${FABRIC_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/fabricConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/fabricConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/fabricConfigVersion.cmake DESTINATION ${FABRIC_CMAKE_DIR})

# pkg-config: static archives, so Libs names everything they need. The files find their prefix
# from where they lie (${pcfiledir}), so `cmake --install --prefix DIR` needs no reconfigure.
file(RELATIVE_PATH FABRIC_PC_UP /root/${CMAKE_INSTALL_LIBDIR}/pkgconfig /root)
# No libfabric here: the engine loads libfabric.so.1 itself when a libfabric domain is opened.
set(FABRIC_PC_REQUIRES "hwloc, spdlog, fmt")
set(FABRIC_PC_LIBS "-lfabriclib -ldl")
set(FABRIC_PC_CFLAGS "")
if(FABRIC_VERBS_ENABLED)
  string(APPEND FABRIC_PC_REQUIRES ", libibverbs")
  string(APPEND FABRIC_PC_CFLAGS " -DFABRIC_WITH_VERBS=1")
endif()
if(FABRIC_CUDA_ENABLED)
  string(APPEND FABRIC_PC_LIBS " -L${CUDAToolkit_LIBRARY_DIR} -lcudart_static -ldl -lrt")
  string(APPEND FABRIC_PC_CFLAGS " -DFABRIC_WITH_CUDA=1")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/fabric.pc.in ${CMAKE_CURRENT_BINARY_DIR}/fabric.pc @ONLY)
configure_file(${CMAKE_CURRENT_LIST_DIR}/fabric-kv.pc.in ${CMAKE_CURRENT_BINARY_DIR}/fabric-kv.pc
  @ONLY)
configure_file(${CMAKE_CURRENT_LIST_DIR}/fabric-ep.pc.in ${CMAKE_CURRENT_BINARY_DIR}/fabric-ep.pc
  @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/fabric.pc ${CMAKE_CURRENT_BINARY_DIR}/fabric-kv.pc
  ${CMAKE_CURRENT_BINARY_DIR}/fabric-ep.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

if(FABRIC_BUILD_TOOLS)
  install(TARGETS fabric-info fabric-bench fabric-bench-raw RUNTIME
    DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
