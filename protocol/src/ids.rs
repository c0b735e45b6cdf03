//! Identifier newtypes. Each is a short lowercase string that is also a valid KV key token
//! (letters, digits, `-` and `_` only).

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        // Deserializing validates like `parse`: ids from the wire become KV keys and
        // subject tokens, so `"a.b"` or `"*"` must be refused, not stored.
        impl TryFrom<String> for $name {
            type Error = InvalidId;
            fn try_from(s: String) -> Result<Self, InvalidId> {
                if is_key_token(&s) {
                    Ok(Self(s))
                } else {
                    Err(InvalidId { kind: stringify!($name), value: s })
                }
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl $name {
            /// The prefix every generated id of this kind starts with.
            pub const PREFIX: &'static str = $prefix;

            /// A new unique id: the prefix and a lowercase ULID (time-ordered).
            pub fn generate() -> Self {
                Self(format!("{}{}", $prefix, ulid::Ulid::new().to_string().to_lowercase()))
            }

            /// Wraps an existing id, checking that it is a valid key token.
            pub fn parse(s: &str) -> Result<Self, InvalidId> {
                Self::try_from(s.to_string())
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        // Hash and Eq of the newtype are those of its string, so maps keyed by the id can
        // be looked up with a `&str` key.
        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = InvalidId;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::parse(s)
            }
        }
    };
}

id_type!(
    /// One node request (a node set asked for by one requestor).
    RequestId, "req-"
);
id_type!(
    /// One node handed out: a slot of a backing node, for the life of one allocation.
    NodeId, "node-"
);
id_type!(
    /// One backing node (a VM or host carved into slots).
    BackingId, "bn-"
);
id_type!(
    /// One running launcher process; holder of leases.
    LauncherId, "launcher-"
);
id_type!(
    /// One entry of the event log (time-ordered).
    EventId, "evt-"
);
id_type!(
    /// The name of a user of the bus (a client, an operator, a launcher): the token its
    /// credentials carry and its API subjects are made of, so who sends a message is
    /// known from the subject the server let it publish on.
    UserName, "user-"
);

/// An id that is not a valid key token.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("invalid {kind} {value:?}: ids are 1-128 characters of a-z, A-Z, 0-9, '-' and '_'")]
pub struct InvalidId {
    pub kind: &'static str,
    pub value: String,
}

/// The longest id (and bus user name).
pub const MAX_ID_LEN: usize = 128;

/// True when `s` can be used as one token of a KV key or NATS subject.
pub fn is_key_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_ID_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl NodeId {
    /// A new node id for slot `slot` of `backing`: `node-<ulid>_<slot>_<backing id>`.
    /// The slot's key can be read back from the id, so any launcher can release a node
    /// from its id alone.
    pub fn for_slot(backing: &BackingId, slot: u32) -> NodeId {
        NodeId(format!(
            "node-{}_{slot}_{backing}",
            ulid::Ulid::new().to_string().to_lowercase()
        ))
    }

    /// The backing node and slot this node id names, if it is of the `for_slot` form.
    pub fn slot(&self) -> Option<(BackingId, u32)> {
        let rest = self.0.strip_prefix(Self::PREFIX)?;
        let (_ulid, rest) = rest.split_once('_')?;
        let (slot, backing) = rest.split_once('_')?;
        Some((BackingId::parse(backing).ok()?, slot.parse().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_are_key_tokens_and_unique() {
        let a = NodeId::generate();
        let b = NodeId::generate();
        assert_ne!(a, b);
        assert!(a.as_str().starts_with("node-"));
        assert!(is_key_token(a.as_str()));
    }

    #[test]
    fn deserialize_validates_like_parse() {
        let id: NodeId = serde_json::from_str(r#""node-1""#).unwrap();
        assert_eq!(serde_json::to_string(&id).unwrap(), r#""node-1""#);
        let err = serde_json::from_str::<RequestId>(r#""req.>""#).unwrap_err();
        assert!(err.to_string().contains("invalid RequestId"), "{err}");
    }

    #[test]
    fn node_ids_name_their_slot() {
        let b = BackingId::parse("bn-x_y").unwrap();
        let n = NodeId::for_slot(&b, 12);
        assert!(is_key_token(n.as_str()), "{n}");
        assert_eq!(n.slot(), Some((b, 12)));
        assert_eq!(NodeId::parse("node-abc").unwrap().slot(), None);
    }

    #[test]
    fn parse_rejects_subject_metacharacters() {
        for bad in ["", "a.b", "a*", "a>", "a b", &"x".repeat(129)] {
            assert!(BackingId::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(BackingId::parse("host-1_a").unwrap().as_str(), "host-1_a");
    }
}
