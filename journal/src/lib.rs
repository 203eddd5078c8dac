//! The only writer: accepts signed commands, authorizes, builds PDUs, appends durably to the fjall journal
