//! `hatrain-scenarios`: the multi-process scenario tests (`tests/*.rs`), the
//! benchmarks (`benches/*.rs`), and [`mapworker`], a small workload of its
//! own that the tests run under the agent.

pub mod mapworker;
