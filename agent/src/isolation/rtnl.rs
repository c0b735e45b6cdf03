//! The route-netlink requests that set up a slot's network ([`super::netns`]): a veth
//! pair, an address, a link up, a default route. The messages are netlink-packet-route's,
//! sent on a socket of the namespace they change, each acknowledged before the next; a
//! warm-up starts no `ip` for them (two program starts per warm-up before, the largest
//! share of a users-mode host's CPU after the agents themselves: docs/benchmarks.md).

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{BorrowedFd, OwnedFd};

use netlink_packet_core::{
    NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE,
    NLM_F_EXCL, NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use rustix::net::{AddressFamily as Domain, RecvFlags, SendFlags, SocketFlags, SocketType};

/// The index of `lo` in every network namespace.
pub const LOOPBACK_INDEX: u32 = 1;
/// The kernel's main routing table.
const MAIN_TABLE: u8 = 254;
/// A reply larger than this is cut (a link's description is about 1.5 KiB).
const RECEIVE_BUFFER: usize = 32 * 1024;

/// A route-netlink socket of one network namespace.
pub struct Rtnl {
    socket: OwnedFd,
    sequence: u32,
}

impl Rtnl {
    /// A socket of the calling thread's network namespace.
    pub fn open() -> io::Result<Rtnl> {
        let socket = rustix::net::socket_with(
            Domain::NETLINK,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            // Protocol 0: NETLINK_ROUTE.
            None,
        )?;
        Ok(Rtnl {
            socket,
            sequence: 0,
        })
    }

    /// A socket of the network namespace `net_ns`: made on a thread of its own that
    /// joins the namespace (a socket keeps the namespace it was made in), so no thread
    /// of the caller's changes namespace.
    pub fn open_in(net_ns: BorrowedFd<'_>) -> io::Result<Rtnl> {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    rustix::thread::move_into_link_name_space(
                        net_ns,
                        Some(rustix::thread::LinkNameSpaceType::Network),
                    )?;
                    Rtnl::open()
                })
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the namespace's thread panicked")))
        })
    }

    /// Adds the veth pair `name`/`peer`, `name` up, the peer in the network namespace of
    /// `peer_pid` (and down: the kernel opens no end before both are made).
    pub fn add_veth(&mut self, name: &str, peer: &str, peer_pid: u32) -> io::Result<()> {
        let mut peer_end = LinkMessage::default();
        peer_end.attributes = vec![
            LinkAttribute::IfName(peer.to_string()),
            LinkAttribute::NetNsPid(peer_pid),
        ];
        let mut link = LinkMessage::default();
        link.header.flags = LinkFlags::Up;
        link.header.change_mask = LinkFlags::Up;
        link.attributes = vec![
            LinkAttribute::IfName(name.to_string()),
            LinkAttribute::LinkInfo(vec![
                LinkInfo::Kind(InfoKind::Veth),
                LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer_end))),
            ]),
        ];
        self.change(
            RouteNetlinkMessage::NewLink(link),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .map(drop)
    }

    /// Deletes the link `name`; one that is not there is an error of kind `NotFound`
    /// (the kernel's `ENODEV`).
    pub fn delete_link(&mut self, name: &str) -> io::Result<()> {
        let mut link = LinkMessage::default();
        link.attributes = vec![LinkAttribute::IfName(name.to_string())];
        self.change(RouteNetlinkMessage::DelLink(link), 0)
            .map(drop)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ENODEV) => io::Error::new(io::ErrorKind::NotFound, e),
                _ => e,
            })
    }

    /// The index of the link `name`.
    pub fn index(&mut self, name: &str) -> io::Result<u32> {
        let mut link = LinkMessage::default();
        link.attributes = vec![LinkAttribute::IfName(name.to_string())];
        self.change(RouteNetlinkMessage::GetLink(link), 0)?
            .into_iter()
            .find_map(|reply| match reply {
                RouteNetlinkMessage::NewLink(link) => Some(link.header.index),
                _ => None,
            })
            .ok_or_else(|| io::Error::other(format!("the kernel described no link {name}")))
    }

    /// Sets the link `index` up.
    pub fn set_up(&mut self, index: u32) -> io::Result<()> {
        let mut link = LinkMessage::default();
        link.header.index = index;
        link.header.flags = LinkFlags::Up;
        link.header.change_mask = LinkFlags::Up;
        self.change(RouteNetlinkMessage::SetLink(link), 0).map(drop)
    }

    /// Adds `address`/`prefix` to the link `index` (as `ip addr add` does: local and
    /// peer address the same, no broadcast).
    pub fn add_address(&mut self, index: u32, address: Ipv4Addr, prefix: u8) -> io::Result<()> {
        let mut message = AddressMessage::default();
        message.header.family = AddressFamily::Inet;
        message.header.prefix_len = prefix;
        message.header.index = index;
        message.attributes = vec![
            AddressAttribute::Local(IpAddr::V4(address)),
            AddressAttribute::Address(IpAddr::V4(address)),
        ];
        self.change(
            RouteNetlinkMessage::NewAddress(message),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .map(drop)
    }

    /// Adds the default route via `gateway` to the main table (as `ip route add default
    /// via` does).
    pub fn add_default_route(&mut self, gateway: Ipv4Addr) -> io::Result<()> {
        let mut route = RouteMessage::default();
        route.header.address_family = AddressFamily::Inet;
        route.header.table = MAIN_TABLE;
        route.header.protocol = RouteProtocol::Boot;
        route.header.scope = RouteScope::Universe;
        route.header.kind = RouteType::Unicast;
        route.attributes = vec![RouteAttribute::Gateway(RouteAddress::Inet(gateway))];
        self.change(
            RouteNetlinkMessage::NewRoute(route),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .map(drop)
    }

    /// Sends `message` (a request with `flags`, acknowledged) and returns the replies
    /// before the acknowledgement; a refusal is the kernel's error number.
    fn change(
        &mut self,
        message: RouteNetlinkMessage,
        flags: u16,
    ) -> io::Result<Vec<RouteNetlinkMessage>> {
        self.sequence = self.sequence.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        header.sequence_number = self.sequence;
        let mut request = NetlinkMessage::new(header, NetlinkPayload::from(message));
        request.finalize();
        let mut bytes = vec![0; request.buffer_len()];
        request.serialize(&mut bytes);
        rustix::net::send(&self.socket, &bytes, SendFlags::empty())?;
        let mut replies = Vec::new();
        let mut buffer = vec![0u8; RECEIVE_BUFFER];
        loop {
            let (_, got) = rustix::net::recv(&self.socket, &mut buffer[..], RecvFlags::empty())?;
            let mut datagram = buffer.get(..got).ok_or_else(|| {
                io::Error::other(format!(
                    "a reply of {got} bytes: more than {RECEIVE_BUFFER}"
                ))
            })?;
            while !datagram.is_empty() {
                let length = NetlinkBuffer::new_checked(datagram)
                    .map_err(|e| io::Error::other(format!("an unreadable reply: {e}")))?
                    .length() as usize;
                let (one, rest) = datagram.split_at(length.min(datagram.len()).max(1));
                datagram = rest;
                let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(one)
                    .map_err(|e| io::Error::other(format!("an unreadable reply: {e}")))?;
                if reply.header.sequence_number != self.sequence {
                    continue;
                }
                match reply.payload {
                    NetlinkPayload::Error(e) if e.code.is_none() => return Ok(replies),
                    NetlinkPayload::Error(e) => return Err(e.to_io()),
                    NetlinkPayload::InnerMessage(inner) => replies.push(inner),
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `test` on a thread in a network namespace of its own (root only).
    fn in_new_netns(test: impl FnOnce() + Send) -> bool {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return false;
        }
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    // SAFETY: this thread shares nothing that depends on its namespace.
                    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET) }
                        .unwrap();
                    test();
                })
                .join()
                .unwrap()
        });
        true
    }

    #[test]
    fn a_refusal_is_the_kernels_error_and_a_missing_link_is_not_found() {
        in_new_netns(|| {
            let mut rtnl = Rtnl::open().unwrap();
            rtnl.set_up(LOOPBACK_INDEX).unwrap();
            let gone = rtnl.delete_link("spn-not-here").unwrap_err();
            assert_eq!(gone.kind(), io::ErrorKind::NotFound, "{gone}");
            let taken = rtnl.add_address(LOOPBACK_INDEX, Ipv4Addr::LOCALHOST, 8);
            assert_eq!(
                taken.unwrap_err().raw_os_error(),
                Some(libc::EEXIST),
                "lo, up, has 127.0.0.1/8 already"
            );
            let index = rtnl.index("lo").unwrap();
            assert_eq!(index, LOOPBACK_INDEX);
            assert!(rtnl.index("spn-not-here").is_err());
        });
    }
}
