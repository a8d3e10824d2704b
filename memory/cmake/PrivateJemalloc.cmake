# Makes a private copy of jemalloc: every public symbol of libjemalloc_pic.a (malloc,
# free, mallocx, mallctl, operator new, ...) is renamed to strata_je_<name>, so linking
# it gives strata a jemalloc to call through mallocx/dallocx while the process keeps its
# own malloc. See Note [Private jemalloc] in memory/src/jemalloc_arena.cpp.
#
#   cmake -DIN=libjemalloc_pic.a -DOUT=libstrata_jemalloc.a -DNM=nm -DOBJCOPY=objcopy -P PrivateJemalloc.cmake
execute_process(COMMAND ${NM} -g --defined-only ${IN}
                OUTPUT_VARIABLE listing RESULT_VARIABLE rc ERROR_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "PrivateJemalloc: ${NM} could not list ${IN}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(renames "")
set(count 0)
foreach(line IN LISTS lines)
  # "0000000000000000 T mallocx": keep defined globals that are not jemalloc-internal (je_*).
  if(line MATCHES "^[0-9a-fA-F]+ [A-Za-z] (.+)$")
    set(name "${CMAKE_MATCH_1}")
    if(NOT name MATCHES "^(je_|_rjem_|DW\\.ref\\.)")
      string(APPEND renames "${name} strata_je_${name}\n")
      math(EXPR count "${count} + 1")
    endif()
  endif()
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "PrivateJemalloc: found no public symbols in ${IN}")
endif()
file(WRITE ${OUT}.syms "${renames}")
execute_process(COMMAND ${OBJCOPY} --redefine-syms=${OUT}.syms ${IN} ${OUT} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "PrivateJemalloc: ${OBJCOPY} failed on ${IN}")
endif()
