//! Free TCP ports on loopback for the agents, daemons and stores a test
//! starts.

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    free_ports::<1>()[0]
}

/// `N` free TCP ports on loopback, all different (see [`free_port_list`]).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let ports = free_port_list(N);
    std::array::from_fn(|i| ports[i])
}

/// `n` free TCP ports on loopback, all different. Each listener is held
/// until every port is picked: ports picked one after the other can be the
/// same one, since the kernel may hand a port just closed out again.
pub fn free_port_list(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a free port"))
        .collect();
    held.iter()
        .map(|l| l.local_addr().expect("a bound port").port())
        .collect()
}
