//! `hatrain-scenarios`: the multi-process scenario tests (`tests/*.rs`) and
//! the benchmarks (`benches/*.rs`) of hatrain. The library itself is empty;
//! the targets start the project's binaries as real processes.
