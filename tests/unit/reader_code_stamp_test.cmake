# cmake/reader_code_stamp.cmake, run on scratch sources: the stamp follows every byte and every
# name of the files it hashes, and not the folder they are checked out in. Then the build's own
# stamp (STAMP_CPP, written by the build) is the one its sources give now.
# Run by ctest: cmake -DSCRIPT=... -DWORK=... -DSOURCES=... -DROOT=... -DSTAMP_CPP=... -P this file.
string(REPLACE "|" ";" SOURCES "${SOURCES}")

function(stamp_of root files out)
  set(list "")
  foreach(f IN LISTS files)
    list(APPEND list "${root}/${f}")
  endforeach()
  string(JOIN "|" arg ${list})
  execute_process(COMMAND ${CMAKE_COMMAND} "-DFILES=${arg}" "-DROOT=${root}" "-DOUT=${WORK}/stamp.cpp" -P "${SCRIPT}"
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "reader_code_stamp.cmake failed: ${rc}")
  endif()
  file(READ "${WORK}/stamp.cpp" text)
  string(REGEX MATCH "kReaderCodeStamp\\[\\] = \"([0-9a-f]+)\"" found "${text}")
  if(NOT CMAKE_MATCH_1)
    message(FATAL_ERROR "no stamp in ${WORK}/stamp.cpp:\n${text}")
  endif()
  set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
endfunction()

function(expect_differ a b what)
  if(a STREQUAL b)
    message(FATAL_ERROR "the stamp did not change when ${what}")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}/one/format/torch" "${WORK}/two/format/torch")
file(WRITE "${WORK}/one/format/torch/torch.cpp" "int ReadTorch() { return 1; }\n")
file(WRITE "${WORK}/one/format/registry.cpp" "// the registry\n")
set(files format/torch/torch.cpp format/registry.cpp)
stamp_of("${WORK}/one" "${files}" first)
stamp_of("${WORK}/one" "${files}" again)
if(NOT first STREQUAL again)
  message(FATAL_ERROR "two runs on the same files gave ${first} and ${again}")
endif()

file(COPY "${WORK}/one/format" DESTINATION "${WORK}/two")
stamp_of("${WORK}/two" "${files}" elsewhere)
if(NOT first STREQUAL elsewhere)
  message(FATAL_ERROR "the same files in another folder gave ${elsewhere}, not ${first}")
endif()

file(WRITE "${WORK}/one/format/torch/torch.cpp" "int ReadTorch() { return 2; }\n")
stamp_of("${WORK}/one" "${files}" edited)
expect_differ("${first}" "${edited}" "one byte of a reader changed")

file(RENAME "${WORK}/two/format/registry.cpp" "${WORK}/two/format/detection.cpp")
stamp_of("${WORK}/two" "format/torch/torch.cpp;format/detection.cpp" renamed)
expect_differ("${first}" "${renamed}" "a file was renamed")

file(WRITE "${WORK}/two/format/torch/new_reader.cpp" "// a new reader\n")
stamp_of("${WORK}/two" "format/torch/torch.cpp;format/detection.cpp;format/torch/new_reader.cpp" added)
expect_differ("${renamed}" "${added}" "a file was added")

# The build's stamp is the one of its sources as they are now.
stamp_of("${ROOT}" "${SOURCES}" current)
file(READ "${STAMP_CPP}" built)
string(FIND "${built}" "\"${current}\"" at)
if(at EQUAL -1)
  message(FATAL_ERROR "the build's stamp (${STAMP_CPP}) is not ${current}, the stamp of its sources now")
endif()
file(REMOVE_RECURSE "${WORK}")
message(STATUS "reader code stamp follows its sources (${current})")
