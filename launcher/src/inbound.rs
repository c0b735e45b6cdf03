//! What every handler of the launcher's request-reply API does with what comes in:
//! decoding a message (size, JSON, protocol version), the errors refused input gets, and
//! the ownership check of a client's requests and nodes. Used by [`crate::api`],
//! [`crate::admin`] and [`crate::status`].

use serde::de::DeserializeOwned;
use slotpool_protocol::api::{ApiError, ErrorCode};
use slotpool_protocol::connect::Incoming;
use slotpool_protocol::{UserName, MAX_MESSAGE_BYTES, PROTOCOL_VERSION};

pub fn bad(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::BadRequest, message)
}

pub fn internal(err: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Internal, err.to_string())
}

/// Decodes a message, refusing oversized ones and other protocol versions.
pub fn decode<T: DeserializeOwned>(
    msg: &Incoming,
    what: &str,
    version: impl Fn(&T) -> u32,
) -> Result<T, ApiError> {
    if msg.payload.len() > MAX_MESSAGE_BYTES {
        return Err(ApiError::new(
            ErrorCode::TooLarge,
            format!(
                "{what} is {} bytes; the limit is {MAX_MESSAGE_BYTES}",
                msg.payload.len()
            ),
        ));
    }
    let value: T = serde_json::from_slice(&msg.payload)
        .map_err(|err| bad(format!("malformed {what}: {err}")))?;
    let v = version(&value);
    if v != PROTOCOL_VERSION {
        return Err(ApiError::new(
            ErrorCode::UnsupportedVersion,
            format!("{what} has v={v}; this launcher speaks v={PROTOCOL_VERSION}"),
        ));
    }
    Ok(value)
}

/// Refuses a caller that is not the client a request or node belongs to.
pub fn check_owner(
    caller: &UserName,
    owner: Option<&UserName>,
    what: impl FnOnce() -> String,
) -> Result<(), ApiError> {
    if owner == Some(caller) {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::Forbidden,
        format!(
            "{} belongs to another client; {caller} may release or cancel only its own",
            what()
        ),
    ))
}
